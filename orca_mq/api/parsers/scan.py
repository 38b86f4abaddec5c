"""The machinery every output parser shares.

A parser is a state machine that reads the model's text once, left to right, whatever its pieces:
`feed` runs its `step` over the held-back tail and the new piece, `finish` settles what is left
(`end`). Only a possible partial marker is ever held back as `carry` (the longest end of the text that
begins a marker, at most a marker's length; a mistral name, a harmony header: bounded too) — except
a tool call, whose raw text is kept in `region` until the call is known complete (it is then sent
whole) or malformed (the raw text goes out as content, and reading goes on where it broke). Markers
are found with one regex of escaped literals (no quantifier: linear), so no text is read twice but
the few characters of a carry.

The unstreamed parse is the same code fed once (`parse_all`): a parser's result does not depend on
where its input was cut.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from orca_mq.api.parsers.delta import CallDelta, Delta, Parsed
from orca_mq.api.parsers.json_scan import JsonScan, loads
from orca_mq.api.stream import partial_tail

WS = re.compile(r"[ \t\r\n]*")
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class Marks:
    """Literal markers, and the pattern that finds the first of them (the longest where several begin
    at one place)."""

    names: tuple[str, ...]
    pattern: re.Pattern[str]


def marks(*names: str) -> Marks:
    return Marks(names, re.compile("|".join(map(re.escape, sorted(names, key=len, reverse=True)))))


def begins(s: str, i: int, *names: str) -> bool:
    """Whether s ends inside one of `names` begun at i (s[i:] is a proper beginning of it)."""
    rest = len(s) - i
    return any(rest < len(m) and m.startswith(s[i:]) for m in names)


def openai_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def mistral_id() -> str:
    """Mistral's templates refuse a tool call id that is not 9 letters or digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def call_of(value: Any, tools: Collection[str], keys: tuple[str, ...] = ("arguments",)) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call {"name": ..., <key>: {...}} naming one of `tools`; None
    where it is not one. Arguments absent are {}; arguments given as a JSON string of an object are
    taken (some models quote them)."""
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or name not in tools:
        return None
    args = arguments(next((value[k] for k in keys if k in value), {}))
    return None if args is None else (name, args)


def arguments(args: Any) -> str | None:
    """An arguments value as JSON text of an object, None where it is not an object."""
    if isinstance(args, str):
        args = loads(args)
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


@dataclass(slots=True)
class Sink:
    """One feed's output, in pieces (joined once, by take)."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[CallDelta] = field(default_factory=list)

    def take(self) -> Delta:
        out = Delta("".join(self.content), "".join(self.reasoning), self.calls)
        self.content, self.reasoning, self.calls = [], [], []
        return out


@dataclass(slots=True)
class Scanner:
    reading: ClassVar[frozenset[str]] = frozenset()    # the states inside a call
    tools: frozenset[str] = frozenset()    # the names a call may have (any other is malformed)
    state: str = "text"
    out: Sink = field(default_factory=Sink)
    carry: str = ""                        # a possible partial marker, held until the next piece
    region: list[str] = field(default_factory=list)   # the raw text of the call being read
    called: int = 0                        # calls sent so far (the next one's index)
    lead: bool = False                     # drop the whitespace that comes next (after a marker or a call)
    json: JsonScan = field(default_factory=JsonScan)
    value: list[str] = field(default_factory=list)    # the JSON text of the call being read

    def feed(self, text: str) -> Delta:
        s, self.carry = self.carry + text, ""
        i = 0
        while i < len(s):
            if self.lead:
                i = WS.match(s, i).end()
                if i == len(s):
                    break
                self.lead = False
            i = self.step(s, i)
        return self.out.take()

    def finish(self, reason: str) -> Delta:
        """The rest, once the output ended for `reason` (`length`: cut by max_tokens, where a call
        begun and a marker held are dropped)."""
        held, self.carry = self.carry, ""
        self.end(held, reason == "length")
        return self.out.take()

    def step(self, s: str, i: int) -> int:
        """Reads on from s[i]; returns where it stopped (len(s) after setting carry: needs more)."""
        raise NotImplementedError

    def end(self, held: str, cut: bool) -> None:
        """The output ended: the marker held is text, a call it ended inside is malformed — both dropped
        where it was cut."""
        if cut:
            self.region.clear()
        elif self.state in self.reading:
            self.give_back(held)
        else:
            self.out.content.append(held)

    def hold(self, s: str, i: int) -> int:
        self.carry = s[i:]
        return len(s)

    def upto(self, s: str, i: int, find: Marks, emit: Callable[[str], Any]) -> tuple[int, str | None]:
        """Emits s[i:] up to the first of `find` (less a possible partial one at the end, held); returns
        (the index past the mark, the mark), or (len(s), None) where none is whole yet."""
        if m := find.pattern.search(s, i):
            if m.start() > i:
                emit(s[i:m.start()])
            return m.end(), m.group()
        end = len(s) - min(partial_tail(s, list(find.names)), len(s) - i)
        if end > i:
            emit(s[i:end])
        self.carry = s[end:]
        return len(s), None

    def text_until(self, s: str, i: int, openers: Marks, then: str) -> int:
        """Content up to the first of `openers`, which begins a call's raw text (and state `then`)."""
        j, mark = self.upto(s, i, openers, self.out.content.append)
        if mark is not None:
            self.begin(mark)
            self.state = then
        return j

    def begin(self, opener: str) -> None:
        """A call's raw text starts with `opener`; its JSON value comes next."""
        self.region.append(opener)
        self.json, self.value = JsonScan(), []

    def read_json(self, s: str, i: int) -> int:
        """Reads on into the call's JSON value (JsonScan.scan)."""
        j = self.json.scan(s, i)
        self.region.append(s[i:j])
        self.value.append(s[i:j])
        return j

    def decoded(self) -> Any:
        return loads("".join(self.value))

    def send(self, name: str, args: str, new_id: Callable[[], str] = openai_id) -> None:
        self.out.calls.append(CallDelta(self.called, new_id(), name, args))
        self.called += 1
        self.region.clear()
        self.lead = True

    def give_back(self, held: str = "") -> None:
        """A malformed call: its raw text is content, and the text goes on after it."""
        self.out.content.append("".join(self.region) + held)
        self.region.clear()
        self.state = "text"


class Stage(Protocol):
    def feed(self, text: str) -> Delta: ...

    def finish(self, reason: str) -> Delta: ...


def parse_all(parser: Stage, text: str, reason: str) -> Parsed:
    """The unstreamed parse: the same parser fed the whole output once."""
    return Parsed().add(parser.feed(text)).add(parser.finish(reason))
