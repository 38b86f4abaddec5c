"""Choosing the parsers: by name (`--tool-call-parser`, `--reasoning-parser`) or from the chat template
(`detect`: which markers it renders), and one OutputParser per generated output that runs the
reasoning parser first and the tool-call parser on its answer.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal, get_args

from orca_mq.api.parsers.delta import Delta
from orca_mq.api.parsers.harmony import Harmony
from orca_mq.api.parsers.hermes import Hermes
from orca_mq.api.parsers.llama3 import Llama3Json
from orca_mq.api.parsers.mistral import Mistral
from orca_mq.api.parsers.reasoning import Think, starts_inside
from orca_mq.api.parsers.scan import Scanner

ToolParserName = Literal["hermes", "llama3_json", "mistral", "gpt_oss"]
ReasoningParserName = Literal["think", "qwen3", "deepseek_r1", "gpt_oss"]   # qwen3, deepseek_r1: vLLM's names for think
TOOL_PARSERS: dict[str, type[Hermes | Llama3Json | Mistral | Harmony]] = {
    "gpt_oss": Harmony, "mistral": Mistral, "hermes": Hermes, "llama3_json": Llama3Json}   # detect's order
REASONING_PARSERS: dict[str, type[Think | Harmony]] = {"gpt_oss": Harmony, "think": Think, "qwen3": Think, "deepseek_r1": Think}
assert set(TOOL_PARSERS) == set(get_args(ToolParserName)) and set(REASONING_PARSERS) == set(get_args(ReasoningParserName))


@dataclass(frozen=True, slots=True)
class Detected:
    tool_parser: ToolParserName | None
    reasoning_parser: ReasoningParserName | None


def detect(template: str) -> Detected:
    """The parsers a chat template's markers call for (None: it renders no such format)."""
    tool = next((name for name, cls in TOOL_PARSERS.items() if cls.renders(template)), None)
    reasoning: ReasoningParserName | None = "gpt_oss" if tool == "gpt_oss" else "think" if Think.renders(template) else None
    return Detected(tool, reasoning)  # type: ignore[arg-type]


@dataclass(slots=True)
class OutputParser:
    """One output's parse: feed it the text as it streams, then finish it with the finish reason."""

    reasoning: Scanner | None     # first (gpt_oss: the only one, its deltas carry the calls too)
    tools: Scanner | None         # on the answer the reasoning parser leaves

    def feed(self, text: str) -> Delta:
        return self._tools(self.reasoning.feed(text) if self.reasoning else Delta(text))

    def finish(self, reason: str) -> Delta:
        if self.reasoning is None:
            return self.tools.finish(reason) if self.tools else Delta()
        out = self._tools(self.reasoning.finish(reason))
        if self.tools:
            last = self.tools.finish(reason)
            out.content += last.content
            out.calls += last.calls
        return out

    def _tools(self, d: Delta) -> Delta:
        if self.tools is None:
            return d
        out = self.tools.feed(d.content)
        out.reasoning = d.reasoning
        return out


def output_parser(tool_parser: str | None, reasoning_parser: str | None, tools: Collection[str],
                  prompt: str = "") -> OutputParser:
    """The parser of one output. `tools`: the names a call may have (none: calls are not parsed, they
    stay text); `prompt`: the rendered prompt, or its end (whether the output begins inside a
    thinking block). gpt_oss parses both at once, so it goes with itself or with nothing."""
    if tool_parser is not None and tool_parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {tool_parser!r}: one of {', '.join(TOOL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}: one of {', '.join(REASONING_PARSERS)}")
    names = frozenset(tools)
    if "gpt_oss" in (tool_parser, reasoning_parser):
        if {tool_parser, reasoning_parser} - {"gpt_oss", None}:
            raise ValueError("the gpt_oss parser reads both the reasoning and the tool calls: pair it with itself")
        return OutputParser(Harmony(tools=names), None)
    calls = TOOL_PARSERS[tool_parser](tools=names) if tool_parser and names else None
    think = None
    if reasoning_parser:
        think = Think(inside=starts_inside(prompt), also_ends=calls.openers if calls else ())
    return OutputParser(think, calls)
