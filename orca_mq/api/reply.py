"""One choice's output through the model's parsers, the one path every API's view shows it by (chat
completions, Responses, Messages): the answer, the thinking and the tool calls, streamed (`feed` each
piece of text as it comes, after stop strings, then `finish`) or whole (`whole`: the parser fed the
text at once). The parser is made at the first piece, when the rendered prompt's end has come with
the first tokens (whether the output begins inside a thinking block).

Where the engine kept special tokens for the parser (orca_mq.api.chat_format) and the request did not
ask for them, they are left out of the answer and the thinking. The reason a response reports is
`finish_reason`'s: `length` stays, an output with calls ended `tool_calls`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orca_mq.api.chat_format import ChatFormat
from orca_mq.api.parsers import Delta, OutputParser, Parsed, finish_reason, parse_all
from orca_mq.api.stream import Generation

if TYPE_CHECKING:
    from orca_mq.api.schemas import ChatCompletionRequest


@dataclass(slots=True)
class Reply:
    fmt: ChatFormat
    tools: frozenset[str]        # the names a call may have (the tools shown)
    strip: bool                  # leave special tokens out of what is shown
    parser: OutputParser | None = None
    parsed: Parsed = field(default_factory=Parsed)    # everything so far
    reason: str | None = None    # the reason the response reports, once finished
    reasoning_tokens: int = 0    # the thinking's tokens, once finished

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> "Reply":
        """A choice's reply to a request bound to the model's format (ChatCompletionRequest.bind)."""
        return cls(body.format, frozenset(t.function.name for t in body.shown_tools), body.strip_specials)

    def feed(self, gen: Generation, text: str) -> Delta:
        return self._shown(self._parser(gen).feed(text))

    def finish(self, gen: Generation) -> Delta:
        """The rest, once the output ended (gen.finish_reason)."""
        out = self._shown(self._parser(gen).finish(gen.finish_reason or "stop"))
        self._done(gen)
        return out

    def whole(self, gen: Generation, text: str) -> Parsed:
        """The whole output parsed at once (the same result as fed in pieces, wherever they were cut)."""
        parsed = parse_all(self._parser(gen), text, gen.finish_reason or "stop")
        if self.strip:
            parsed.content_parts = [self.fmt.strip(parsed.content)]
            parsed.reasoning_parts = [self.fmt.strip(parsed.reasoning)]
        self.parsed = parsed
        self._done(gen)
        return parsed

    @property
    def content(self) -> str | None:
        """The answer as a message shows it: none where it is only whitespace beside calls."""
        text = self.parsed.content
        return None if self.parsed.calls and not text.strip() else text

    def _parser(self, gen: Generation) -> OutputParser:
        if self.parser is None:
            self.parser = self.fmt.parser(self.tools, gen.prompt_tail or "")
        return self.parser

    def _shown(self, delta: Delta) -> Delta:
        if self.strip:
            delta.content, delta.reasoning = self.fmt.strip(delta.content), self.fmt.strip(delta.reasoning)
        self.parsed.add(delta)
        return delta

    def _done(self, gen: Generation) -> None:
        self.reason = finish_reason(gen.finish_reason or "stop", bool(self.parsed.calls))
        self.reasoning_tokens = self.fmt.count(self.parsed.reasoning) if self.fmt.reasoning_parser else 0
