"""Structured outputs that finish within max_tokens, and JSON numbers of bounded digits.

`plan` finds a short completion from a matcher's state by a greedy walk over single bytes, each
checked by the matcher: the bytes the grammar forces (`compute_ff_bytes`), else the first allowed
byte in an order that closes before it opens (inside a JSON string, its closing quote; outside,
`}` and `]`, then the shortest values, then what goes on). The bytes are spelled in tokens (longest
first) with EOS after them where the grammar accepts but does not stop. A greedy walk can miss a
shorter completion, so a plan's length bounds the shortest from above: forcing a plan that fits
always finishes. `shortest` plans from the start once per constraint, walking each of the first
choices at the choices greedy could get wrong (an enum, a choice among strings): the refusal of a
max_tokens that cannot hold it rests on that length.

A request's `Closing` forces its plan, one token a step, once what is left of max_tokens is no more
than the plan's length and `structured.close_margin`; for `structured.close_guard` tokens before
that, the mask keeps the plan's next token and only the grammar's tokens that open nothing (no new
member, item, key, string or container, no key's text: a token that does can lengthen the way to
close by more than the margin, one that does not by a few tokens at most, as an enum's longer
member). Each planned token is checked by the matcher first (else the grammar's mask stands), and a
plan is made again only where the output left it, the end may be near (a stale plan is taken to
grow by at most JUMP tokens a token) and the old one no longer finishes (checked by the matcher in
microseconds: a string's text, a number's digits leave it as it was).

The digit bound is the grammar's (`Grammar.narrow`, with orca_mq.structured.tokens' masks).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from llguidance import LLMatcher

from orca_mq.structured.tokens import DIGITS, NUMBER, JsonLex, Tables

MAX_PLAN_BYTES = 4096    # a completion longer than this is not planned (no forcing, no refusal)
CHOICES = 12             # `shortest`: first bytes walked at a choice...
WALKED = 8192            # ...and bytes walked in all, then greedy on...
LOST = 256               # ...each walk at most this long where greedy alone found no way (it loops: a*b)
JUMP = 8                 # tokens one free token may add to a plan: a stale plan's bound until recomputed
BYTES_PER_TOKEN = 8      # a request's plan is sought only this many bytes a token left (a closing's tokens are short)
RETRY = 16               # tokens before planning again where no plan was found, doubled each time
REPEAT = 4               # a walk's choice made this many times in a row: a loop (0.000..., an email's 0000...)
NUMBER_BYTES = frozenset(bytes([b]) for b in NUMBER)   # a plan that goes on with the number it stands in is not kept
CLOCK_EVERY = 64         # bytes walked between two looks at a deadline


class OutOfTime(Exception):
    """A search went past its deadline (structured.compile_timeout): it stops, freeing its thread."""


def _check(deadline: float | None, walked: int) -> None:
    if deadline is not None and walked % CLOCK_EVERY == 0 and time.monotonic() > deadline:
        raise OutOfTime


def _order(first: bytes) -> tuple[int, ...]:
    plain = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ _-.,:;!?'()[]{}<>/@#$%^&*+=|~`"
    head = list(first) + [b for b in plain if b not in first]
    return tuple(head) + tuple(b for b in range(256) if b not in head)


IN_STRING = _order(b'"')                  # close the string, else the plainest content
OUTSIDE = _order(b'}]0"[{ntf,:-1')        # close a container, else the shortest value, else go on
IN_NUMBER = _order(b'}],1234567890')      # end the number rather than lengthen it; 0 last: a range may refuse -0 or 0.0...
DIGIT_DUE = _order(b'1234567890')         # after - . e +
ESCAPES = tuple(b'@:./-_+')               # out of a loop: what formats wait for (an email's @, a URI's :)
CLOSERS = frozenset(b'"}]')


def _choices(lex: JsonLex) -> tuple[int, ...]:
    """The bytes to try next, first first."""
    return IN_STRING if lex.in_string else IN_NUMBER if lex.last in DIGITS else DIGIT_DUE if lex.digits >= 0 else OUTSIDE


def _take(m: LLMatcher, lex: JsonLex, tables: Tables, data: bytes) -> bool:
    tokens = [tables.byte_token[b] for b in data]
    if min(tokens) < 0 or m.try_consume_tokens(tokens) != len(tokens):
        return False
    lex.feed(data)
    return True


def _allowed(m: LLMatcher, lex: JsonLex, tables: Tables, limit: int) -> list[int]:
    """The first `limit` bytes the grammar allows next, in closing order."""
    out = []
    for b in _choices(lex):
        t = tables.byte_token[b]
        if t >= 0 and m.try_consume_tokens([t]) == 1:
            m.rollback(1)
            out.append(b)
            if len(out) == limit:
                break
    return out


def _walk(m: LLMatcher, lex: JsonLex, tables: Tables, out: bytearray, cap: int = MAX_PLAN_BYTES,
          deadline: float | None = None) -> bool:
    """Extend `out` greedily until `m` accepts; m and lex follow. False: no completion found within
    `cap` bytes. A byte chosen REPEAT times in a row (forced bytes between) is a loop (0.000..., an
    email's 0000..., (ab)* before d): then first what the loop made possible, then what formats
    wait for, and the bytes that looped or ended a loop last. Raises OutOfTime past `deadline`."""
    repeated, start, check, looped = 0, 0, REPEAT, set()   # the last choice: times in a row, since out[start]
    while not m.is_accepting():
        _check(deadline, len(out))
        if len(out) > cap or m.is_stopped():
            return False
        forced = m.compute_ff_bytes()
        if forced:
            if not _take(m, lex, tables, forced):
                return False
            out += forced
            continue
        order = _choices(lex)
        if repeated >= REPEAT:
            looped.add(out[start])
            novel = _novel(m, tables, order, bytes(out[start:]), looped) if repeated >= check else ()
            check = repeated + 1 if novel else 2 * check   # a loop that opens nothing new is rarely asked again
            order = novel + ESCAPES + tuple(b for b in order if b not in looped) + tuple(b for b in order if b in looped)
        for b in order:
            t = tables.byte_token[b]
            if t >= 0 and m.try_consume_tokens([t]) == 1:
                if repeated >= REPEAT:
                    looped.add(b)
                if repeated and b == out[start]:
                    repeated += 1
                else:
                    repeated, start, check = 1, len(out), REPEAT
                lex.feed(bytes([b]))
                out.append(b)
                break
        else:
            return False
    return True


def _novel(m: LLMatcher, tables: Tables, order: tuple[int, ...], run: bytes, looped: set[int]) -> tuple[int, ...]:
    """The bytes allowed now but not before `run` (the bytes of a loop, just consumed by m), in order,
    those that ended no loop yet first."""
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
    new = [b for b in order if b in now and b not in before]
    return tuple(b for b in new if b not in looped) + tuple(b for b in new if b in looped)


def _tokens(m: LLMatcher, tables: Tables, data: bytes) -> list[int] | None:
    """The plan of `data` (which took `m` to accepting): its tokens, EOS after unless m stopped."""
    tokens = tables.spell(data)
    if tokens is not None and not m.is_stopped():
        tokens.append(tables.eos)
    return tokens


def plan(m: LLMatcher, lex: JsonLex, tables: Tables, cap: int = MAX_PLAN_BYTES) -> list[int] | None:
    """Tokens that end the output from m's state (the last one EOS unless the grammar stops by
    itself); None: none found within `cap` bytes. The bytes are the matcher's; their spelling is
    checked when forced."""
    if m.is_stopped():
        return []
    data, w = bytearray(), m.deep_copy()
    return _tokens(w, tables, bytes(data)) if _walk(w, lex.copy(), tables, data, cap) else None


def shortest(m: LLMatcher, tables: Tables, deadline: float | None = None) -> list[int] | None:
    """The plan from m's state (a fresh matcher's: the start), better than greedy's: at each choice
    whose first allowed byte is not a closer, up to CHOICES of them are each walked to the end (no
    longer than twice greedy's way, WALKED bytes in all) and the way that spells in the fewest
    tokens so far is followed (an enum's shortest member, not its first; `b` for a*b). Raises
    OutOfTime past `deadline` (time.monotonic())."""
    best: bytearray | None = bytearray()
    if not _walk(m.deep_copy(), JsonLex(), tables, best, deadline=deadline):   # type: ignore[arg-type]
        best = None
    cap = LOST if best is None else 2 * len(best) + 8
    fewest = None if best is None else _count(tables, best)
    lex, data, walked, m = JsonLex(), bytearray(), 0, m.deep_copy()
    while not m.is_accepting():
        forced = m.compute_ff_bytes()
        if forced:
            if not _take(m, lex, tables, forced):
                return None
            data += forced
            continue
        options = _allowed(m, lex, tables, CHOICES)
        if len(options) > 1 and (best is None or options[0] not in CLOSERS):
            for b in options:
                if walked > WALKED:
                    break
                way, side, w = data + bytes([b]), lex.copy(), m.deep_copy()
                if _take(w, side, tables, bytes([b])) and _walk(w, side, tables, way, cap, deadline):
                    if (n := _count(tables, way)) is not None and (fewest is None or n < fewest):
                        best, fewest = way, n
                walked += len(way) - len(data)
        if best is None or not _take(m, lex, tables, best[len(data):len(data) + 1]):
            return None
        data.append(best[len(data)])
    return _tokens(m, tables, bytes(data))


def _count(tables: Tables, data: bytes) -> int | None:
    tokens = tables.spell(bytes(data))
    return None if tokens is None else len(tokens)


@dataclass(slots=True)
class Closing:
    """One request's budget: what is left of its max_tokens against a plan to finish."""
    max_tokens: int
    margin: int                      # structured.close_margin
    guard: int                       # structured.close_guard
    plan: list[int] | None           # finishes the output from the state it was made for
    current: bool = True             # made for the current state (else stale)
    since: int = 0                   # tokens since it was made (while stale)
    retry: int = RETRY               # tokens before planning again where no plan was found (doubling)
    min_tokens: int = 0              # EOS is not forced before (min_tokens forbids it there)

    def next(self, m: LLMatcher, lex: JsonLex, tables: Tables, used: int) -> tuple[int, bool] | None:
        """None while the end is far (the grammar's mask stands); else the plan's next token and
        whether it is forced (alone), or offered beside the grammar's tokens that open nothing."""
        left, reach = self.max_tokens - used, self.margin + self.guard
        if not self.current:
            stale = self.plan
            if stale is None and self.since < self.retry or stale is not None and left > len(stale) + reach + JUMP * self.since:
                return None   # a stale plan grows by at most JUMP a token: the end is still far
            if not stale or lex.digits >= 0 and tables.token_bytes[stale[0]][:1] in NUMBER_BYTES or (
                    m.validate_tokens(stale) != len(stale)):   # else the output went on beside it (a string's text)
                cap = min(MAX_PLAN_BYTES, BYTES_PER_TOKEN * (left + reach))   # a longer way could not be forced in time
                self.plan = plan(m, lex, tables, cap)
                self.retry = RETRY if self.plan is not None else 2 * self.retry
            self.current, self.since = True, 0
        p = self.plan
        if not p or left > len(p) + reach or p[0] == tables.eos and used < self.min_tokens:
            return None
        if m.validate_tokens(p[:1]) != 1:   # a spelling the grammar refuses: no plan for a while
            self.plan, self.current = None, False
            return None
        return p[0], left <= len(p) + self.margin

    def accepted(self, token: int) -> None:
        if self.current and self.plan and token == self.plan[0]:
            self.plan = self.plan[1:]
        else:
            self.current = False
            self.since += 1
