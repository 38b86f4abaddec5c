"""The greedy walk a structured output's plans are made of (orca_mq.structured.budget): from a
matcher's state to an accepting one, over single bytes, each checked by the matcher: the bytes the
grammar forces (`compute_ff_bytes`), else the first allowed byte in an order that closes before it
opens (inside a JSON string, its closing quote; outside, `}` and `]`, then the shortest values, then
what goes on). A byte chosen REPEAT times in a row (forced bytes between) is a loop (0.000..., an
email's 0000..., (ab)* before d): then first what the loop made possible, then what formats wait
for, and the bytes that looped or ended a loop last.

A walk can stop and go on (`Walk.run(budget)`): its work is counted in matcher calls (`probes`: a
byte tried, a token consumed), so the scheduler spreads a long one over iterations within each
iteration's budget; a search at admission stops at its deadline (`OutOfTime`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from llguidance import LLMatcher

from orca_mq.structured.tokens import DIGITS, JsonLex, Tables

MAX_PLAN_BYTES = 4096    # a completion longer than this is not planned (no forcing, no refusal)
REPEAT = 4               # a walk's choice made this many times in a row: a loop (0.000..., an email's 0000...)


class OutOfTime(Exception):
    """A search went past its deadline (structured.compile_timeout): it stops, freeing its thread."""


def _order(first: bytes) -> tuple[int, ...]:
    plain = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ _-.,:;!?'()[]{}<>/@#$%^&*+=|~`"
    head = list(first) + [b for b in plain if b not in first]
    return tuple(head) + tuple(b for b in range(256) if b not in head)


IN_STRING = _order(b'"')                  # close the string, else the plainest content
OUTSIDE = _order(b'}]0"[{ntf,:-1')        # close a container, else the shortest value, else go on
IN_NUMBER = _order(b'}],1234567890')      # end the number rather than lengthen it; 0 last: a range may refuse -0 or 0.0...
DIGIT_DUE = _order(b'1234567890')         # after - . e +
ESCAPES = tuple(b'@:./-_+')               # out of a loop: what formats wait for (an email's @, a URI's :)


def choices(lex: JsonLex) -> tuple[int, ...]:
    """The bytes to try next, first first."""
    return IN_STRING if lex.in_string else IN_NUMBER if lex.last in DIGITS else DIGIT_DUE if lex.digits >= 0 else OUTSIDE


def take(m: LLMatcher, lex: JsonLex, tables: Tables, data: bytes) -> bool:
    """Consume `data` byte by byte (m and lex follow); False if the grammar refuses it."""
    tokens = [tables.byte_token[b] for b in data]
    if min(tokens) < 0 or m.try_consume_tokens(tokens) != len(tokens):
        return False
    lex.feed(data)
    return True


@dataclass(slots=True)
class Walk:
    """A walk from `m`'s state (m, a copy the walk owns, and lex follow it; `out` holds its bytes)."""
    m: LLMatcher
    lex: JsonLex
    tables: Tables
    cap: int = MAX_PLAN_BYTES              # no completion within this many bytes: none found
    deadline: float | None = None          # time.monotonic() past which it raises OutOfTime
    out: bytearray = field(default_factory=bytearray)
    probes: int = 0                        # matcher calls so far: its work
    repeated: int = 0                      # the last choice: times in a row...
    start: int = 0                         # ...since out[start]
    check: int = REPEAT                    # a loop's new bytes are sought at this many repeats
    looped: set[int] = field(default_factory=set)

    def run(self, budget: int | None = None) -> bool | None:
        """Walk on: True once m accepts, False when no completion is found within `cap` bytes, None
        when `budget` probes are spent first (run again to go on)."""
        stop = None if budget is None else self.probes + budget
        m, lex, tables, out = self.m, self.lex, self.tables, self.out
        while not m.is_accepting():
            if stop is not None and self.probes >= stop:
                return None
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise OutOfTime
            if len(out) > self.cap or m.is_stopped():
                return False
            forced = m.compute_ff_bytes()
            self.probes += 1 + len(forced)
            if forced:
                if not take(m, lex, tables, forced):
                    return False
                out += forced
                continue
            if not self._step(self._order()):
                return False
        return True

    def _order(self) -> tuple[int, ...]:
        order = choices(self.lex)
        if self.repeated < REPEAT:
            return order
        self.looped.add(self.out[self.start])
        novel = self._novel(order, bytes(self.out[self.start:])) if self.repeated >= self.check else ()
        self.check = self.repeated + 1 if novel else 2 * self.check   # a loop that opens nothing new is rarely asked again
        looped = self.looped
        return novel + ESCAPES + tuple(b for b in order if b not in looped) + tuple(b for b in order if b in looped)

    def _step(self, order: tuple[int, ...]) -> bool:
        """The first byte of `order` the grammar allows, taken; False: none."""
        m, tables, out = self.m, self.tables, self.out
        for b in order:
            t = tables.byte_token[b]
            if t < 0:
                continue
            self.probes += 1
            if m.try_consume_tokens([t]) == 1:
                if self.repeated >= REPEAT:
                    self.looped.add(b)
                if self.repeated and b == out[self.start]:
                    self.repeated += 1
                else:
                    self.repeated, self.start, self.check = 1, len(out), REPEAT
                self.lex.feed(bytes([b]))
                out.append(b)
                return True
        return False

    def _novel(self, order: tuple[int, ...], run: bytes) -> tuple[int, ...]:
        """The bytes allowed now but not before `run` (the bytes of a loop, just consumed by m), in order,
        those that ended no loop yet first."""
        m, tables = self.m, self.tables

        def allowed() -> set[int]:
            ok = set()
            for b in order:
                if (t := tables.byte_token[b]) >= 0 and m.try_consume_tokens([t]) == 1:
                    m.rollback(1)
                    ok.add(b)
            return ok

        now = allowed()
        m.rollback(len(run))
        before = allowed()
        m.try_consume_tokens([tables.byte_token[b] for b in run])
        self.probes += 2 * len(order) + len(run)
        new = [b for b in order if b in now and b not in before]
        return tuple(b for b in new if b not in self.looped) + tuple(b for b in new if b in self.looped)
