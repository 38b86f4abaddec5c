"""What an output parser gives back: a Delta per piece of text fed (the answer's text, the thinking,
the tool calls that piece completed), and Parsed, the deltas of a whole output added up.

A call's first delta carries its index, id and name; its `arguments` fragments, concatenated in
order, are the arguments' JSON text (OpenAI's streamed `tool_calls` shape). The parsers send a
call whole, in one delta, once it is known to be complete and well-formed: a stream cannot take
back a call it began, and a call the model writes malformed must come back as text and one cut
by max_tokens must not come back at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CallDelta:
    index: int              # the call's place among this output's calls, from 0
    id: str | None = None   # on the call's first delta
    name: str | None = None
    arguments: str = ""     # a fragment of the arguments' JSON text


@dataclass(slots=True)
class Delta:
    content: str = ""       # the answer's text
    reasoning: str = ""     # the thinking's text
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


@dataclass(slots=True)
class Call:
    id: str
    name: str
    arguments: str          # JSON text of an object


@dataclass(slots=True)
class Parsed:
    """Deltas added up (pieces kept in lists: adding is linear however many deltas come)."""

    content_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)

    def add(self, delta: Delta) -> "Parsed":
        self.content_parts.append(delta.content)
        self.reasoning_parts.append(delta.reasoning)
        for d in delta.calls:
            if d.index == len(self.calls):
                self.calls.append(Call(d.id or "", d.name or "", d.arguments))
            else:
                self.calls[d.index].arguments += d.arguments
        return self

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)


def finish_reason(engine_reason: str, called: bool) -> str:
    """The reason a response reports: `length` stays (the complete calls are still returned, a cut one
    is dropped); an output with calls ended `tool_calls`; otherwise the engine's (a malformed call came
    back as text: `stop`)."""
    if engine_reason == "length" or not called:
        return engine_reason
    return "tool_calls"
