"""`tool_choice` = `required` or a named function, in the model's own format: a grammar (llguidance's
Lark, through the structured outputs) of the format's calls, each a given tool's name and arguments
valid under its JSON schema, after the thinking the model may write first.

    hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, "\\n" between calls
    llama3_json  {"name": ..., "parameters": {...}}             (one call: Llama's template takes one)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}, "id"?}, ...], or [TOOL_CALLS]name[ARGS]{...}
                 per call where the template renders that (v11+ tokenizers; [CALL_ID]id before [ARGS] where it does)
    gpt_oss      <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}   (one call)

The thinking (`<think>` … `</think>`, less the opening where the template's prompt writes it; or
gpt-oss's analysis message) may come first, as free text. A marker the vocabulary has as an added
token is named by its id (`<[id]>`: no text spells one), any other as text; free text before a token
is any text, before a text marker the shortest text up to it. The budget that forces a constrained
output to finish within max_tokens (orca_mq.structured.budget) plans by bytes: inside a call's JSON it
plans to its end (hermes' closing tag is optional, as the parser takes a call the output ends in), but
no plan crosses free thinking or a token, so a call not yet begun is not forced to fit max_tokens.
"""
from __future__ import annotations

import json
from typing import Any

from orca_mq.api.chat_format import ChatFormat
from orca_mq.api.parsers import harmony, hermes, llama3, mistral, reasoning
from orca_mq.api.tools import Tool

WS = r"/[ \t\r\n]{0,8}/"   # between the thinking and a call (bounded: a model may loop on whitespace)


class _Lark:
    """Grammar pieces for one format: its markers as tokens where the vocabulary has them as added tokens
    (llguidance takes every added token as special: no text spells one); JSON compact or not."""

    def __init__(self, fmt: ChatFormat) -> None:
        self.ids = fmt.added
        self.compact = fmt.compact_json

    def mark(self, text: str) -> str:
        return f"<[{self.ids[text]}]>" if text in self.ids else json.dumps(text)

    def free_until(self, name: str, end: str) -> str:
        """Rules `name`: any text, then the marker `end`."""
        if end in self.ids:
            return f"{name}: /(?s:.*)/ {self.mark(end)}\n"
        return f"{name}: {name}_text\n{name}_text[lazy]: /(?s:.*){_regex(end)}/\n"

    def json(self, schema: dict[str, Any]) -> str:
        """A %json of `schema`, without whitespace between tokens where compact."""
        return f"%json {json.dumps(schema | {'x-guidance': {'whitespace_flexible': not self.compact}})}"

    def calls(self, tools: list[Tool], arguments: str, more: dict[str, Any] | None = None) -> str:
        """A %json of any given tool's call: {"name": its name, <arguments>: its schema's object, `more`'s
        optional properties}."""
        return self.json({"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", arguments],
                                     "properties": {"name": {"const": t.function.name}, arguments: _parameters(t)} | (more or {})}
                                    for t in tools]})


def _regex(text: str) -> str:
    """`text` as a Lark regex's literal (`/` closes the regex: escaped too)."""
    return "".join("\\" + c if c in r"\/.^$*+?()[]{}|" else c for c in text)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}


def _think(g: _Lark, fmt: ChatFormat, thinking: bool) -> str:
    """The rule `think` (empty where the thinking is off or not the think parser's): `<think>` unless the
    prompt opened it, any text, `</think>`."""
    if not thinking:
        return 'think: ""\n'
    opener = "" if fmt.opens_thinking else g.mark(reasoning.OPEN) + " "
    return f"think: {opener}body {WS}\n" + g.free_until("body", reasoning.CLOSE)


def _hermes(g: _Lark, tools: list[Tool], parallel: bool) -> str:
    """The closing tag is optional, as the parser takes a call the output ends in: a budget's plan ends there."""
    more = ' ("\\n" call)*' if parallel else ""
    return (f"start: think? call{more}\n"
            f'call: {g.mark(hermes.OPEN)} "\\n" {g.calls(tools, "arguments")} ("\\n" {g.mark(hermes.CLOSE)})?\n')


def _mistral(g: _Lark, tools: list[Tool], parallel: bool, template: str) -> str:
    """The form the template renders: name[ARGS] (with [CALL_ID] and an id where it renders them), or the
    JSON array (an element's id as its templates write it back; v0.3's spaces around the tag)."""
    if mistral.ARGS in template:
        call_id = f"({g.mark(mistral.CALL_ID)} /[A-Za-z0-9]{{9}}/)? " if mistral.CALL_ID in template else ""
        calls = " | ".join(f"{g.mark(mistral.TAG)} {json.dumps(t.function.name)} {call_id}{g.mark(mistral.ARGS)} "
                           f"{g.json(_parameters(t))}" for t in tools)
        return f"start: think? call{'+' if parallel else ''}\ncall: {calls}\n"
    more = ' ("," " "? item)*' if parallel else ""
    item = g.calls(tools, "arguments", {"id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}})
    return f'start: think? " "? {g.mark(mistral.TAG)} " "? "[" item{more} "]"\nitem: {item}\n'


def _gpt_oss(g: _Lark, tools: list[Tool], thinking: bool) -> str:
    """One call (its <|call|> ends the output), after an analysis message."""
    analysis = (f'analysis: {g.mark(harmony.CHANNEL)} "analysis" {g.mark(harmony.MESSAGE)} body '
                f'{g.mark(harmony.START)} "assistant"\n' + g.free_until("body", harmony.END)) if thinking else 'analysis: ""\n'
    calls = " | ".join(f'{g.mark(harmony.CHANNEL)} {json.dumps(f"commentary to=functions.{t.function.name} ")} '
                       f'{g.mark("<|constrain|>")} "json" {g.mark(harmony.MESSAGE)} {g.json(_parameters(t))}' for t in tools)
    return f"start: analysis? call\ncall: {calls}\n{analysis}"


def constraint(fmt: ChatFormat, tools: list[Tool], parallel: bool, thinking: bool) -> dict[str, Any]:
    """The structured_outputs of a required (or named: `tools` is that one) tool choice; `thinking`: the
    model may think first (a reasoning parser reads it, and the request did not turn it off)."""
    g = _Lark(fmt)
    if fmt.tool_parser == "gpt_oss":
        return {"grammar": _gpt_oss(g, tools, thinking)}
    think = _think(g, fmt, thinking and fmt.reasoning_parser is not None)
    if fmt.tool_parser == "llama3_json":
        body = f"start: think? {g.calls(tools, 'parameters')}\n"
    elif fmt.tool_parser == "mistral":
        body = _mistral(g, tools, parallel, fmt.template)
    else:
        body = _hermes(g, tools, parallel)
    return {"grammar": body + think}
