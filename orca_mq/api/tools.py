"""Tool calling for the chat API: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The model sees its tools the way Hermes-style templates show them (the format vLLM's `hermes` tool
parser reads, and the one small instruction-tuned models follow best): a system message lists the
function signatures inside <tools></tools> and asks for each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; earlier assistant calls and the tools'
results (`role: tool`) are written back into the conversation in that same form, so any chat
template renders them. The reply is parsed back into `message.tool_calls` (text outside the tags
stays the content). With `tool_choice` = `required` or a named function, the output is constrained
to such calls by a grammar whose arguments are the tool's own JSON schema (orca_mq.structured), so
the arguments always validate; with `auto` the model chooses, and only calls that parse and name a
given tool are returned; with `none` the tools are not shown.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from orca_mq.api.stream import partial_tail

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
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


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolCallDelta(ToolCall):
    index: int


def _parameters(fn: Function) -> dict[str, Any]:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


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
                                               "arguments": _arguments(c["function"]["arguments"])}) + f"\n{CLOSE}"
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


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> dict[str, Any] | None:
    """For `required` or a named function: a grammar of one (or, with parallel calls, several)
    <tool_call> blocks, each a given tool's name and arguments valid under its schema."""
    if not tools or choice in (None, "auto", "none"):
        return None
    schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t.function)}}
                        for t in tools]}
    repeat = ' ("\\n" call)*' if parallel else ""
    return {"grammar": f'start: call{repeat}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n'}


def parse(text: str, tools: list[Tool]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply: every <tool_call> block that is JSON naming a given tool; the
    text outside the blocks is the content (None when only calls)."""
    names = {t.function.name for t in tools}
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict):
            calls.append(ToolCall(function=CalledFunction(name=call["name"], arguments=json.dumps(call.get("arguments", {})))))
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return content or None, calls


def held(text: str) -> int:
    """How many characters at the end of streamed text may begin a <tool_call> tag (held back until known)."""
    if OPEN in text:
        return len(text) - text.index(OPEN)
    return partial_tail(text, [OPEN])


class ToolReply:
    """A chat reply with tools shown, as it streams: text that may begin a <tool_call> is held back,
    and the calls go out, parsed, with the final chunk."""

    def __init__(self, tools: list[Tool]) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0   # characters of `text` sent as content

    def stream(self, piece: str, final: bool) -> tuple[str, list[ToolCallDelta] | None]:
        """(content to send now, the calls: only with the final piece)."""
        self.text += piece
        if not final:
            end = len(self.text) - held(self.text[self.sent:])
            out, self.sent = self.text[self.sent:end], end
            return out, None
        _, calls = parse(self.text, self.tools)
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        if not calls:
            return rest, None
        return _CALL.sub("", rest).strip(), [ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(calls)]
