"""Structured outputs that finish within max_tokens, and JSON numbers of bounded digits.

A plan is a short completion from a matcher's state, found by a greedy walk over single bytes
(orca_mq.structured.walk), spelled in tokens (longest first) with EOS after them where the grammar
accepts but does not stop. A greedy walk can miss a
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
grow by at most JUMP tokens a token) and neither the old one (a string's text, a number's digits
leave it as it was) nor the old one less as many bytes as the token that left it (a letter of a
run of letters in place of another) still finishes, checked by the matcher.

What planning costs the scheduler is bounded per iteration (`Budget`, structured.plan_budget matcher
calls, the rows in order): `Closing.prepare` runs before an iteration is built; a request whose
planning does not fit sits the iteration out, its walk going on at the next from where it stopped
(its state waits with it), so it pays for its own planning in its own latency. Speculation's forks
prepare within the same budget, their drafts cut where it runs out.

The digit bound is the grammar's (`Grammar.narrow`, with orca_mq.structured.tokens' masks).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from llguidance import LLMatcher

from orca_mq.structured.tokens import NUMBER, JsonLex, Tables
from orca_mq.structured.walk import MAX_PLAN_BYTES, OutOfTime, Walk, choices, take

__all__ = ["Budget", "Closing", "MAX_PLAN_BYTES", "OutOfTime", "shortest"]

CHOICES = 12             # `shortest`: first bytes walked at a choice...
WALKED = 8192            # ...and bytes walked in all, then greedy on...
LOST = 256               # ...each walk at most this long where greedy alone found no way (it loops: a*b)
JUMP = 8                 # tokens one free token may add to a plan: a stale plan's bound until recomputed
BYTES_PER_TOKEN = 8      # a request's plan is sought only this many bytes a token left (a closing's tokens are short)
RETRY = 16               # tokens before planning again where no plan was found, doubled each time
NUMBER_BYTES = frozenset(bytes([b]) for b in NUMBER)   # a plan that goes on with the number it stands in is not kept
CLOSERS = frozenset(b'"}]')


def _allowed(m: LLMatcher, lex: JsonLex, tables: Tables, limit: int) -> list[int]:
    """The first `limit` bytes the grammar allows next, in closing order."""
    out = []
    for b in choices(lex):
        t = tables.byte_token[b]
        if t >= 0 and m.try_consume_tokens([t]) == 1:
            m.rollback(1)
            out.append(b)
            if len(out) == limit:
                break
    return out


def _tokens(m: LLMatcher, tables: Tables, data: bytes) -> list[int] | None:
    """The plan of `data` (which took `m` to accepting): its tokens, EOS after unless m stopped."""
    tokens = tables.spell(data)
    if tokens is not None and not m.is_stopped():
        tokens.append(tables.eos)
    return tokens


def shortest(m: LLMatcher, tables: Tables, deadline: float | None = None) -> list[int] | None:
    """The plan from m's state (a fresh matcher's: the start), better than greedy's: at each choice
    whose first allowed byte is not a closer, up to CHOICES of them are each walked to the end (no
    longer than twice greedy's way, WALKED bytes in all) and the way that spells in the fewest
    tokens so far is followed (an enum's shortest member, not its first; `b` for a*b). Raises
    OutOfTime past `deadline` (time.monotonic())."""
    greedy = Walk(m.deep_copy(), JsonLex(), tables, deadline=deadline)
    best: bytearray | None = greedy.out if greedy.run() else None
    cap = LOST if best is None else 2 * len(best) + 8
    fewest = None if best is None else _count(tables, best)
    lex, data, walked, m = JsonLex(), bytearray(), 0, m.deep_copy()
    while not m.is_accepting():
        forced = m.compute_ff_bytes()
        if forced:
            if not take(m, lex, tables, forced):
                return None
            data += forced
            continue
        options = _allowed(m, lex, tables, CHOICES)
        if len(options) > 1 and (best is None or options[0] not in CLOSERS):
            for b in options:
                if walked > WALKED:
                    break
                side, w = lex.copy(), m.deep_copy()
                if take(w, side, tables, bytes([b])):
                    way = Walk(w, side, tables, cap, deadline, data + bytes([b]))
                    if way.run() and (n := _count(tables, way.out)) is not None and (fewest is None or n < fewest):
                        best, fewest = way.out, n
                    walked += len(way.out) - len(data)
        if best is None or not take(m, lex, tables, best[len(data):len(data) + 1]):
            return None
        data.append(best[len(data)])
    return _tokens(m, tables, bytes(data))


def _finishes(m: LLMatcher, tokens: list[int], eos: int) -> bool:
    """Whether `tokens` end the output from m's state: all taken, the last EOS or the grammar stopped after them."""
    if tokens[-1] == eos:
        return m.validate_tokens(tokens) == len(tokens)
    n = m.try_consume_tokens(tokens)
    stopped = n == len(tokens) and m.is_stopped()
    m.rollback(n)
    return stopped


def _count(tables: Tables, data: bytes) -> int | None:
    tokens = tables.spell(bytes(data))
    return None if tokens is None else len(tokens)


@dataclass(slots=True)
class Budget:
    """The planning one iteration may still spend, in matcher calls (None: unbounded), shared by its rows in order."""
    left: int | None

    def spend(self, n: int) -> None:
        if self.left is not None:
            self.left -= n

    @property
    def spent(self) -> bool:
        return self.left is not None and self.left <= 0


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
    shifted: list[int] | None = None   # stale: the plan less as many bytes as the token that left it
    walk: Walk | None = None         # a plan being sought, from the current state: it goes on where it stopped

    def copy(self) -> "Closing":
        """A copy to advance apart (a speculative fork): its plans copied, no walk."""
        return replace(self, plan=None if self.plan is None else list(self.plan), shifted=None, walk=None)

    def prepare(self, m: LLMatcher, lex: JsonLex, tables: Tables, used: int, budget: Budget | None = None) -> bool:
        """Bring the plan up to date where this step needs it (the end may be near and the output left
        the plan). False: the planning that takes is not done within `budget`; the walk goes on at the
        next call, from where it stopped (the state must not move meanwhile: the request sits out)."""
        if self.current:
            return True
        left, reach = self.max_tokens - used, self.margin + self.guard
        if self.walk is None:
            stale = self.plan
            if stale is None and self.since < self.retry or stale is not None and left > len(stale) + reach + JUMP * self.since:
                return True   # a stale plan grows by at most JUMP a token: the end is still far
            if budget is not None and budget.spent:
                return False
            if stale and not (lex.digits >= 0 and tables.token_bytes[stale[0]][:1] in NUMBER_BYTES):
                for kept in (self.shifted, stale):   # in place of the plan's head, or on beside it (a string's text)
                    if kept:
                        if budget is not None:
                            budget.spend(len(kept))
                        if _finishes(m, kept, tables.eos):
                            self.plan, self.current, self.since, self.shifted = kept, True, 0, None
                            return True
            if m.is_stopped():
                self.plan, self.current, self.since = [], True, 0
                return True
            cap = min(MAX_PLAN_BYTES, BYTES_PER_TOKEN * (left + reach))   # a longer way could not be forced in time
            self.walk = Walk(m.deep_copy(), lex.copy(), tables, cap)
        before = self.walk.probes
        done = self.walk.run(None if budget is None or budget.left is None else max(budget.left, 0))
        if budget is not None:
            budget.spend(self.walk.probes - before)
        if done is None:
            return False
        self.plan = _tokens(self.walk.m, tables, bytes(self.walk.out)) if done else None
        self.retry = RETRY if self.plan is not None else 2 * self.retry
        self.walk, self.shifted, self.current, self.since = None, None, True, 0
        return True

    def next(self, m: LLMatcher, lex: JsonLex, tables: Tables, used: int) -> tuple[int, bool] | None:
        """None while the end is far (the grammar's mask stands); else the plan's next token and
        whether it is forced (alone), or offered beside the grammar's tokens that open nothing.
        Prepares the plan where the scheduler did not (unbounded)."""
        self.prepare(m, lex, tables, used)
        if not self.current:
            return None
        p = self.plan
        if not p or self.max_tokens - used > len(p) + self.margin + self.guard or p[0] == tables.eos and used < self.min_tokens:
            return None
        if m.validate_tokens(p[:1]) != 1:   # a spelling the grammar refuses: no plan for a while
            self.plan, self.current = None, False
            return None
        return p[0], self.max_tokens - used <= len(p) + self.margin

    def accepted(self, token: int, tables: Tables) -> None:
        p = self.plan
        if self.current and p and token == p[0]:
            self.plan = p[1:]
            return
        base = p if self.current else self.shifted   # its head as many bytes long as the token, dropped
        n, k = len(tables.token_bytes[token]) if token < len(tables.token_bytes) else 0, 0
        while base and n > 0 and k < len(base):
            n, k = n - len(tables.token_bytes[base[k]]), k + 1
        self.shifted = base[k:] if base and n == 0 and k else None
        self.current, self.walk = False, None
        self.since += 1
