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
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, Field

from orca_mq.api.stream import partial_tail

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


class ArgumentsError(ValueError):
    """An earlier call's arguments that cannot be written back (nested deeper than the JSON parser goes)."""

    def __init__(self, param: str) -> None:
        super().__init__(f"{param}: JSON nested too deeply to read")
        self.param = param


def render(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, str]]:
    """The conversation as plain {role, content} messages, the tools in a system message and earlier
    calls and results in the <tool_call> / <tool_response> form. Raises ArgumentsError naming the field."""
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                               "arguments": _arguments(c["function"]["arguments"],
                                                                       f"messages.{i}.tool_calls.{j}.function.arguments")})
                     + f"\n{CLOSE}" for j, c in enumerate(m["tool_calls"])]
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


def _arguments(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text
    except RecursionError:
        raise ArgumentsError(param) from None


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


def _blocks(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each <tool_call>...</tool_call> block, left to right, each OPEN to the first CLOSE
    after it. Found with str.find, so linear in the text: a regex's lazy body between two `\\s*` backtracks
    in cubic time on a long run of whitespace, which a model can write."""
    at = 0
    while (start := text.find(OPEN, at)) >= 0 and (close := text.find(CLOSE, start + len(OPEN))) >= 0:
        at = close + len(CLOSE)
        yield start, at


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):   # not JSON, or nested deeper than the parser goes
        return None
    if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict):
        return ToolCall(function=CalledFunction(name=call["name"], arguments=json.dumps(call.get("arguments", {}))))
    return None


def parse(text: str, tools: list[Tool]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply: every <tool_call> block that is JSON naming a given tool; the
    text outside the blocks is the content (None when only calls). Linear in the text."""
    names = {t.function.name for t in tools}
    spans = list(_blocks(text))
    calls = [c for start, end in spans if (c := _call(text[start + len(OPEN):end - len(CLOSE)].strip(), names))]
    if not calls:
        return text, []
    kept, at = [], 0
    for start, end in spans:
        kept.append(text[at:start])
        at = end
    content = "".join(kept + [text[at:]]).strip()
    return content or None, calls


class ToolReply:
    """A chat reply with tools shown, as it streams: text that may begin a <tool_call> is held back,
    and the calls go out, parsed, with the final chunk. A piece costs its own length: from the first
    OPEN on everything is held, and the reply is parsed once, at the end."""

    def __init__(self, tools: list[Tool]) -> None:
        self.tools = tools
        self.unsent = ""                      # before any OPEN: the end that may begin one
        self.held: list[str] | None = None    # from the first OPEN on

    def stream(self, piece: str, final: bool) -> tuple[str, list[ToolCallDelta] | None]:
        """(content to send now, the calls: only with the final piece)."""
        out = ""
        if self.held is not None:
            self.held.append(piece)
        else:
            text = self.unsent + piece
            if (at := text.find(OPEN)) >= 0:
                out, self.unsent, self.held = text[:at], "", [text[at:]]
            else:
                keep = partial_tail(text, [OPEN])
                out, self.unsent = text[:len(text) - keep], text[len(text) - keep:]
        if not final:
            return out, None
        rest = out + self.unsent + "".join(self.held or ())
        self.unsent, self.held = "", None
        content, calls = parse(rest, self.tools)
        if not calls:
            return rest, None
        return content or "", [ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(calls)]
