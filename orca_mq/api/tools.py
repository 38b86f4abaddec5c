"""Tool calling for the chat API: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

A model whose chat template renders tools gets them there, in its own format (orca_mq.api.chat_format).
Any other sees them the way Hermes-style templates show them (the format vLLM's `hermes` tool parser
reads, and the one small instruction-tuned models follow best): `render` writes a system message that
lists the function signatures inside <tools></tools> and asks for each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and writes earlier assistant calls and the
tools' results (`role: tool`) back into the conversation in that same form, so any chat template
renders them. The reply is parsed back by the format's parser (orca_mq.api.parsers); `required` or a
named function constrain it (orca_mq.api.tool_grammar); with `none` the tools are not shown.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
SYSTEM = ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
          "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
          "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
          "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
          "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


class Function(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None   # a JSON schema; absent = no arguments
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: str
    arguments: str          # JSON text, as OpenAI returns it
    _value: Any = PrivateAttr(default=None)
    _read: bool = PrivateAttr(default=False)

    def value(self) -> Any:
        """The arguments as a template renders them (arguments_of), read once: the request's validation reads
        them first (a RecursionError there is a 400), the prompt's rendering takes what it read."""
        if not self._read:
            self._value, self._read = arguments_of(self.arguments), True
        return self._value


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolCallDelta(ToolCall):
    index: int


def shown(tools: list[Tool] | None, choice: ToolChoice | None) -> list[Tool]:
    """The tools the model is shown: none for `none`, the named one for a named choice."""
    if not tools or choice == "none":
        return []
    if isinstance(choice, NamedToolChoice):
        return [t for t in tools if t.function.name == choice.function.name]
    return list(tools)


def render(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, str]]:
    """The conversation as plain {role, content} messages, the tools in a system message and earlier
    calls and results in the <tool_call> / <tool_response> form."""
    out: list[dict[str, str]] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                               "arguments": arguments_of(c["function"]["arguments"])}) + f"\n{CLOSE}"
                     for c in m["tool_calls"]]
            content = "\n".join([content] * bool(content) + calls)
        elif m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools:
        listed = "\n".join(json.dumps({"type": "function", "function": t.function.model_dump(exclude_none=True)}) for t in tools)
        system = SYSTEM.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def arguments_of(text: str) -> Any:
    """An earlier call's arguments as the template renders them: the JSON value, or the text where it is none."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text
