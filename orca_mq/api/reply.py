"""One choice's output through the model's parsers, the one path every API's view shows it by (chat
completions, Responses, Messages): the answer, the thinking and the tool calls, streamed (`feed` each
piece of text as it comes, after stop strings, then `finish`) or whole (`whole`: the parser fed the
text at once). The parser is made at the first piece, when the rendered prompt's end has come with
the first tokens (whether the output begins inside a thinking block).

Where the engine kept special tokens for the parser (orca_mq.api.chat_format) and the request did not
ask for them, they are left out of the answer and the thinking. Whitespace that begins the answer is
held until text follows it, and is no answer beside calls (the chat API's null content, no Responses
message, no Messages text block). The reason a response reports is `finish_reason`'s: `length` stays,
an output with calls ended `tool_calls`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orca_mq.api.chat_format import ChatFormat
from orca_mq.api.parsers import CallDelta, Delta, OutputParser, Parsed, finish_reason, parse_all
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
    held: str | None = ""        # whitespace that may begin the answer, until text follows it (None: it has)

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> "Reply":
        """A choice's reply to a request bound to the model's format (ChatCompletionRequest.bind)."""
        return cls(body.format, frozenset(t.function.name for t in body.shown_tools), body.strip_specials)

    def feed(self, gen: Generation, text: str) -> Delta:
        return self._shown(self._parser(gen).feed(text))

    def finish(self, gen: Generation) -> Delta:
        """The rest, once the output ended (gen.finish_reason)."""
        out = self._shown(self._parser(gen).finish(gen.finish_reason or "stop"), last=True)
        self._done(gen)
        return out

    def whole(self, gen: Generation, text: str) -> Parsed:
        """The whole output parsed at once (the same result as fed in pieces, wherever they were cut)."""
        self._shown(_as_delta(parse_all(self._parser(gen), text, gen.finish_reason or "stop")), last=True)
        self._done(gen)
        return self.parsed

    def delta(self) -> Delta:
        """The whole reply as one delta (what a view that streams is fed when it does not)."""
        return _as_delta(self.parsed)

    @property
    def content(self) -> str | None:
        """The answer as a message shows it: none where it is only whitespace beside calls (then held)."""
        return None if self.parsed.calls and not self.parsed.content else self.parsed.content

    def _parser(self, gen: Generation) -> OutputParser:
        if self.parser is None:
            self.parser = self.fmt.parser(self.tools, gen.prompt_tail or "")
        return self.parser

    def _shown(self, delta: Delta, last: bool = False) -> Delta:
        """What the client sees of `delta`: without special tokens where stripped, the answer's leading
        whitespace held until text follows it (and dropped at the end beside calls)."""
        if self.strip:
            delta.content, delta.reasoning = self.fmt.strip(delta.content), self.fmt.strip(delta.reasoning)
        if self.held is not None:
            text = self.held + delta.content
            if text.strip() or last and not (self.parsed.calls or delta.calls):
                delta.content, self.held = text, None
            else:
                delta.content, self.held = "", text
        self.parsed.add(delta)
        return delta

    def _done(self, gen: Generation) -> None:
        self.reason = finish_reason(gen.finish_reason or "stop", bool(self.parsed.calls))
        self.reasoning_tokens = self.fmt.count(self.parsed.reasoning) if self.fmt.reasoning_parser else 0


def _as_delta(p: Parsed) -> Delta:
    return Delta(p.content, p.reasoning, [CallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(p.calls)])
