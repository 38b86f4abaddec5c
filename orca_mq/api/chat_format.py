"""How the served model speaks tools and thinking: the parsers its outputs go through and how its
tools reach the prompt, resolved once per API process from `server.tool_call_parser`,
`server.reasoning_parser` and the tokenizer's chat template.

- "auto" names the parsers the template's markers call for (orca_mq.api.parsers.detect). A template
  that renders `tools` in a format a parser reads gets them (apply_chat_template(tools=...)), with the
  conversation's calls, results and thinking as message fields; otherwise orca-mq shows the tools in
  a system message of its own and asks for hermes `<tool_call>` blocks (orca_mq.api.tools.render).
- A named parser is used as named, the template rendering the tools where it does; "none" parses no
  tool calls (a request with tools is refused) or no reasoning.
- Where a parser's markers are special tokens (llama3_json, mistral, gpt_oss), the engine's text keeps
  special tokens and the API leaves them out of what it shows (`strip`) unless the request asked
  for them (skip_special_tokens: false).
"""
from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orca_mq.api.parsers import REASONING_PARSERS, TOOL_PARSERS, OutputParser, detect, output_parser
from orca_mq.api.parsers import harmony, hermes, llama3, mistral, reasoning
from orca_mq.api.parsers.reasoning import starts_inside

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.tokenizer import Tokenizer

# each parser's markers: where one is a special token of the vocabulary, the parser needs special tokens kept
MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": (hermes.OPEN, hermes.CLOSE), "llama3_json": (llama3.TAG,), "mistral": (mistral.TAG, mistral.ARGS, mistral.CALL_ID),
    "gpt_oss": (harmony.START, harmony.CHANNEL, harmony.MESSAGE, harmony.END, harmony.CALL, harmony.RETURN, "<|constrain|>"),
    "think": (reasoning.OPEN, reasoning.CLOSE)}
for _name in (*TOOL_PARSERS, *REASONING_PARSERS):
    MARKERS.setdefault(_name, MARKERS["think"])   # qwen3, deepseek_r1: think's
PROBE_TOOL = "orca_mq_probe_tool"   # a tool whose name in the rendered probe says the template renders tools
_BASE62 = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ChatFormat:
    tool_parser: str | None          # None: tool calls are not parsed
    reasoning_parser: str | None
    template_tools: bool             # tools, calls and results go to the template as it takes them
    template: str = ""               # the chat template's text (grammars read which form it renders)
    opens_thinking: bool = False     # its generation prompt leaves a <think> block open (the R1 distills')
    compact_json: bool = True        # a tool call's JSON without whitespace between tokens (structured.json_whitespace)
    added: dict[str, int] = field(default_factory=dict)   # each added token's id by its text (grammars name them by id)
    specials: frozenset[str] = frozenset()                   # the texts of those that are special
    count: Callable[[str], int] = len   # a text's tokens (usage's reasoning_tokens)
    strip_pattern: re.Pattern[str] | None = None                # any special token's text

    @property
    def keeps_specials(self) -> bool:
        """The parsers read special tokens: the engine's text must keep them."""
        return any(m in self.specials for p in (self.tool_parser, self.reasoning_parser) if p for m in MARKERS[p])

    def parser(self, tools: frozenset[str], prompt_tail: str) -> OutputParser:
        return output_parser(self.tool_parser, self.reasoning_parser, tools, prompt_tail)

    def strip(self, text: str) -> str:
        """`text` without special tokens (what skip_special_tokens shows)."""
        return self.strip_pattern.sub("", text) if self.strip_pattern is not None and text else text

    def call_id(self, given: str) -> str:
        """A call id as the template takes it back: mistral's are 9 letters or digits (a client's own ids
        are mapped to such, the same every time)."""
        if self.tool_parser != "mistral" or re.fullmatch(r"[A-Za-z0-9]{9}", given):
            return given
        n = int.from_bytes(hashlib.sha256(given.encode()).digest()[:8], "big")
        return "".join(_BASE62[(n // 62 ** i) % 62] for i in range(9))


PLAIN = ChatFormat("hermes", None, False)   # orca-mq's own system message: what any template can show


def resolve(config: Config, tokenizer: Tokenizer) -> ChatFormat:
    """The format of the model whose tokenizer this is (renders a probe once: call it off the event loop)."""
    cfg = config.server
    template = tokenizer.chat_template
    text = template if isinstance(template, str) else "\n".join(map(str, (template or {}).values()))
    found = detect(text)
    renders = bool(text) and _renders_tools(tokenizer)
    tool: str | None = cfg.tool_call_parser
    reasoning: str | None = found.reasoning_parser if cfg.reasoning_parser == "auto" else cfg.reasoning_parser
    if tool == "auto":
        tool, renders = (found.tool_parser, True) if found.tool_parser and renders else ("hermes", False)
    elif tool == "none":
        tool = None
    if reasoning == "none":
        reasoning = None
    if "gpt_oss" in (tool, reasoning):   # harmony's parser reads both (config.check refuses another beside it)
        tool = reasoning = "gpt_oss"
    added = tokenizer.added_tokens_decoder
    specials = frozenset(t.content for t in added.values() if t.special)
    pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))) if specials else None
    return ChatFormat(tool, reasoning, renders, text, bool(text) and starts_inside(_probe(tokenizer, None)),
                      config.structured.json_whitespace == "compact", {t.content: i for i, t in added.items()}, specials,
                      lambda s: len(tokenizer.encode(s, False)) if s else 0, pattern)


def _renders_tools(tokenizer: Tokenizer) -> bool:
    tool = {"type": "function", "function": {"name": PROBE_TOOL, "description": "", "parameters": {"type": "object",
                                                                                                   "properties": {}}}}
    return PROBE_TOOL in _probe(tokenizer, [tool])


def _probe(tokenizer: Tokenizer, tools: list[dict[str, Any]] | None) -> str:
    """A one-message conversation rendered with its generation prompt ("" where the template refuses it)."""
    try:
        return tokenizer.render_chat([{"role": "user", "content": "Hi"}], tools, True)
    except Exception:
        return ""
