"""POST /v1/responses' request (OpenAI's Responses API), strict as the chat API's, and the chat request
it stands for (`chat`): the Responses API is a view of the chat path, not a second one.

    input          a string (one user message) or items: messages (`role` user / system / developer /
                   assistant, `content` a string or input_text / output_text parts), `function_call`,
                   `function_call_output`, `reasoning` (its text becomes the next assistant turn's thinking)
    instructions   a system message before the input (not carried by previous_response_id, as OpenAI)
    tools          function tools ({"type": "function", "name", "description", "parameters", "strict"})
    tool_choice    none | auto | required | {"type": "function", "name"}; parallel_tool_calls
    text.format    text | json_object | json_schema ({"name", "schema", "strict"}): structured outputs
    max_output_tokens, temperature, top_p, stream, store, previous_response_id, reasoning.effort (the
    template's reasoning_effort: gpt-oss'), metadata and user (kept, unused); chat_template_kwargs,
    skip_special_tokens and structured_outputs as vLLM's extensions.

Items an earlier response returned come back as the SDK writes them (ids, status, annotations, logprobs:
accepted, unused).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from orca_mq.api.errors import from_validation
from orca_mq.api.fields import at_most, bounded, http
from orca_mq.api.schemas import MAX_MESSAGES, JsonSchemaFormat, Strict
from orca_mq.api.tools import MAX_TOOLS, Function

MAX_ITEMS = MAX_MESSAGES   # input items of one request (each a message at least)


class _Item(Strict):
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)


class TextPart(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None        # an output_text's, as returned: unused
    logprobs: list[Any] | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    phase: str | None = Field(None, max_length=32)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(max_length=64)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextPart]


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: None = None          # orca-mq writes none, so takes none back


def _kind(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_kind)]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    UNSUPPORTED = {"verbosity": ("medium",)}
    format: TextFormat | None = None


class ReasoningConfig(Strict):
    effort: Literal["minimal", "low", "medium", "high"] | None = None   # the template's reasoning_effort
    summary: Literal["auto", "concise", "detailed"] | None = None        # accepted: the thinking comes whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Strict):
    UNSUPPORTED = {"background": (False,), "include": ([],), "max_tool_calls": (), "prompt": (), "top_logprobs": (0,),
                   "truncation": ("disabled",), "service_tier": ("auto", "default"), "conversation": (),
                   "prompt_cache_key": (), "safety_identifier": (), "stream_options": ()}

    model: str | None = None
    input: Annotated[str | list[InputItem], at_most(MAX_ITEMS)]   # one too_long, not the union's errors
    instructions: str | None = None
    tools: bounded(list[FunctionTool], MAX_TOOLS) | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    max_output_tokens: http("max_tokens") | None = None
    temperature: http("temperature") | None = None
    top_p: http("top_p") | None = None
    stream: bool = Field(False, strict=True)
    store: bool = Field(True, strict=True)
    previous_response_id: str | None = Field(None, max_length=256)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM extensions, as the chat API's
    skip_special_tokens: bool | None = Field(None, strict=True)
    structured_outputs: dict[str, Any] | None = None

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (an earlier turn's calls on its assistant message, their outputs as
        tool messages, a reasoning item's text as the next assistant turn's thinking); no instructions."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        # each assistant turn's text and thinking (by its place in out), in pieces joined once at the end:
        # adding each item's text to the turn's string copied all of it per item (quadratic in the input)
        texts: dict[int, tuple[list[str], list[str]]] = {}
        thinking: list[str] = []
        for item in self.input:
            if isinstance(item, ReasoningItem):
                thinking += [p.text for p in item.content or item.summary]
                continue
            if isinstance(item, FunctionCallOutputItem):
                text = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
                continue
            if isinstance(item, MessageItem) and item.role != "assistant":
                out.append({"role": item.role, "content": item.text})
                continue
            turn = out[-1] if out else {}   # an assistant's text and calls join its turn, text before calls
            if turn.get("role") != "assistant" or (isinstance(item, MessageItem) and turn.get("tool_calls")):
                turn = {"role": "assistant", "content": None}
                out.append(turn)
            content, reasoning = texts.setdefault(len(out) - 1, ([], []))
            if isinstance(item, MessageItem):
                content.append(item.text)
            else:
                turn.setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
            reasoning += thinking
            thinking = []
        for i, (content, reasoning) in texts.items():
            if content:
                out[i]["content"] = "".join(content)
            if thought := "".join(reasoning):
                out[i]["reasoning_content"] = thought
        return out

    def chat(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request this one stands for, after `history` (a previous response's conversation)."""
        fmt = self.text.format if self.text is not None else None
        choice = {"type": "function", "function": {"name": self.tool_choice.name}} \
            if isinstance(self.tool_choice, NamedTool) else self.tool_choice
        kwargs = (self.chat_template_kwargs or {}) | (
            {"reasoning_effort": self.reasoning.effort} if self.reasoning and self.reasoning.effort else {})
        body = {"model": self.model, "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
                "max_tokens": self.max_output_tokens, "parallel_tool_calls": self.parallel_tool_calls,
                "tool_choice": choice, "skip_special_tokens": self.skip_special_tokens,
                "chat_template_kwargs": kwargs or None, "user": self.user, "structured_outputs": self.structured_outputs,
                "messages": ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
                + history + self.messages(),
                "tools": None if self.tools is None else [
                    {"type": "function", "function": Function(name=t.name, description=t.description,
                                                              parameters=t.parameters, strict=t.strict).model_dump()}
                    for t in self.tools],
                "response_format": None if fmt is None else {"type": fmt.type} | (
                    {"json_schema": JsonSchemaFormat(name=fmt.name or "output", schema=fmt.schema_,
                                                     strict=fmt.strict).model_dump(by_alias=True)}
                    if fmt.type == "json_schema" else {})}
        return {k: v for k, v in body.items() if v is not None}


def validated(model: type[Strict], data: dict[str, Any]) -> Any:
    """`data` as `model` (the chat request a view builds), a 400 naming the field where it is refused."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation([err | {"loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]) from None
