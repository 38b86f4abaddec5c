"""POST /v1/messages' request (Anthropic's Messages API), strict as the chat API's, and the chat request it
stands for (`chat`): the Messages API is a view of the chat path.

    system          a string or text blocks: a system message first
    messages        user / assistant turns, content a string or blocks: text, tool_use (an assistant's
                    call: id, name, input), tool_result (a user's: tool_use_id, content, is_error),
                    thinking (an assistant's, its text the turn's thinking; redacted_thinking dropped)
    tools           {name, description, input_schema} ("custom"); tool_choice auto | any | tool | none,
                    disable_parallel_tool_use
    thinking        enabled | disabled: the chat template's enable_thinking (budget_tokens not enforced);
                    adaptive: the template's default
    output_config   format {type: json_schema, schema}: structured outputs
    max_tokens, stop_sequences, temperature, top_p, top_k, stream, metadata.user_id; cache_control accepted;
                    structured_outputs as vLLM's extension
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from orca_mq.api.fields import bounded, http
from orca_mq.api.schemas import MAX_MESSAGES, MAX_STOP_LEN, MAX_STOP_STRINGS, Strict
from orca_mq.api.tools import MAX_TOOLS
from orca_mq.protocol.sampling_fields import INT32_MAX


class _Block(Strict):
    cache_control: dict[str, Any] | None = None    # prompt caching's hint: the prefix cache needs none


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(max_length=64)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


class UnsupportedBlock(Strict):
    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        raise PydanticCustomError("unsupported_parameter", "content blocks of type '{kind}' are not supported (text, "
                                  "tool_use, tool_result and thinking only)", {"param": "content", "kind": data["type"]})


UNSUPPORTED_BLOCKS = frozenset({"image", "document", "search_result", "server_tool_use", "web_search_tool_result",
                                "container_upload"})


def _kind(block: Any) -> str:
    kind = str(block.get("type")) if isinstance(block, dict) else ""
    return "unsupported" if kind in UNSUPPORTED_BLOCKS else kind


Block = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
                  | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
                  | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
                  | Annotated[UnsupportedBlock, Tag("unsupported")], Discriminator(_kind)]


class MessageParam(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolParam(Strict):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoiceParam(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = Field(None, strict=True)

    @model_validator(mode="after")
    def _named(self) -> "ToolChoiceParam":
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("value_error", "a tool_choice of type tool names its tool (and only it does)",
                                      {"param": "tool_choice"})
        return self


class ThinkingParam(Strict):
    type: Literal["enabled", "disabled", "adaptive"]                          # adaptive: the template's default
    budget_tokens: int | None = Field(None, strict=True, ge=1, le=INT32_MAX)   # accepted, not enforced
    display: Literal["summarized", "omitted"] | None = None                    # accepted: the thinking comes whole


class JsonFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: JsonFormat | None = None                                            # structured outputs
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None     # accepted, unused


class Metadata(Strict):
    user_id: str | None = Field(None, max_length=256)


class MessagesRequest(Strict):
    UNSUPPORTED = {"container": (), "mcp_servers": ([],), "service_tier": ("auto", "standard_only"),
                   "context_management": (), "diagnostics": (), "inference_geo": (), "speed": (), "user_profile_id": (),
                   "workspace_id": ()}

    model: str = Field(max_length=256)
    max_tokens: http("max_tokens")
    messages: bounded(list[MessageParam], MAX_MESSAGES, least=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: bounded(list[str], MAX_STOP_STRINGS) | None = None
    stream: bool = Field(False, strict=True)
    temperature: http("temperature", high=1.0) | None = None   # Anthropic's range
    top_p: http("top_p") | None = None
    top_k: http("top_k") | None = None
    tools: bounded(list[ToolParam], MAX_TOOLS) | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    cache_control: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None   # vLLM's extension, as the chat API's

    @model_validator(mode="after")
    def _stops(self) -> "MessagesRequest":
        if any(not 0 < len(s) <= MAX_STOP_LEN for s in self.stop_sequences or []):
            raise PydanticCustomError("value_error", "stop_sequences: strings of 1 to {chars} characters",
                                      {"chars": MAX_STOP_LEN, "param": "stop_sequences"})
        return self

    def messages_as_chat(self) -> list[dict[str, Any]]:
        """The turns as chat messages: a user turn's tool results first as tool messages, then its text; an
        assistant turn's text, thinking and tool_use blocks as one message's content, thinking and calls."""
        out: list[dict[str, Any]] = []
        if self.system is not None:
            out.append({"role": "system", "content": self.system if isinstance(self.system, str)
                        else "".join(b.text for b in self.system)})
        for m in self.messages:
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            if m.role == "user":
                out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
                        for b in blocks if isinstance(b, ToolResultBlock)]
                texts = [b.text for b in blocks if isinstance(b, TextBlock)]
                if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                    out.append({"role": "user", "content": "".join(texts)})
                continue
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            out.append(turn | ({"tool_calls": calls} if calls else {}) | ({"reasoning_content": thinking} if thinking else {}))
        return out

    def chat(self) -> dict[str, Any]:
        """The chat request this one stands for."""
        choice = self.tool_choice
        body = {"model": self.model, "max_tokens": self.max_tokens, "messages": self.messages_as_chat(),
                "stop": self.stop_sequences, "stream": self.stream, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "user": self.metadata.user_id if self.metadata else None,
                "tools": None if self.tools is None else [
                    {"type": "function", "function": {"name": t.name, "description": t.description,
                                                      "parameters": t.input_schema}} for t in self.tools],
                "tool_choice": None if choice is None else {"type": "function", "function": {"name": choice.name}}
                if choice.type == "tool" else {"auto": "auto", "any": "required", "none": "none"}[choice.type],
                "parallel_tool_calls": None if choice is None or choice.disable_parallel_tool_use is None
                else not choice.disable_parallel_tool_use,
                "chat_template_kwargs": None if self.thinking is None or self.thinking.type == "adaptive"
                else {"enable_thinking": self.thinking.type == "enabled"},
                "structured_outputs": self.structured_outputs,
                "response_format": None if self.output_config is None or self.output_config.format is None else {
                    "type": "json_schema", "json_schema": {"name": "output", "schema": self.output_config.format.schema_}}}
        return {k: v for k, v in body.items() if v is not None}
