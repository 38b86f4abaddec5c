"""One request's grammar state: an llguidance matcher advanced by the request's accepted tokens.

It lives on the scheduler's Request, so FastServe's preemption and KV offload leave it as it is.
EOS is allowed by the mask only where the grammar accepts; a grammar that can take nothing more
(or has taken EOS) ends its request with "stop". `narrow` takes each step's mask further
(orca_mq.structured.budget): the token that closes the output within max_tokens, else the bound on
a JSON number's digits.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from orca_mq.structured.budget import Budget, Closing
from orca_mq.structured.tokens import JsonLex, Tables

if TYPE_CHECKING:
    from orca_mq.tokenizer import Tokenizer

LIMITS = llguidance.LLParserLimits(verbose_errors=False)   # llguidance's default work bounds; errors without the grammar dump


@dataclass(slots=True)
class Vocabulary:
    """The model's tokens as llguidance sees them, shared by every grammar of a process, and the
    executor that computes an iteration's masks."""
    tokenizer: LLTokenizer
    size: int                           # the logits' width: a mask has one bit per token
    executor: LLExecutor
    tables: Tables                      # the tokens as bytes: plans to close, the digit bound

    @classmethod
    def of(cls, tokenizer: Tokenizer, size: int, eos_token_ids: list[int], threads: int) -> "Vocabulary":
        tok = LLTokenizer(tokenizer.json(), n_vocab=size, eos_token=list(eos_token_ids))   # = llguidance.hf's, without transformers
        return cls(tok, size, LLExecutor(threads or None), Tables.of(tok, size))


@dataclass(slots=True)
class Grammar:
    kind: str
    matcher: LLMatcher | None          # None once released
    vocab: Vocabulary
    tokens: int = 0                    # tokens accepted
    complete: bool = False             # the output so far matches the constraint whole
    start: list[int] | None = None     # the constraint's shortest plan from the start (budget.shortest)
    max_digits: int = 0                # a JSON number's most digits (0: unbounded)
    margin: int = 0                    # structured.close_margin
    guard: int = 0                     # structured.close_guard
    lex: JsonLex = field(default_factory=JsonLex)
    closing: Closing | None = None     # set by `limit`: the budget the output finishes within

    def limit(self, max_tokens: int, min_tokens: int = 0) -> None:
        """Finish within max_tokens: its plan is forced as the budget runs out (EOS not before min_tokens)."""
        self.closing = Closing(max_tokens, self.margin, self.guard, None if self.start is None else list(self.start),
                               min_tokens=min_tokens)

    def prepare(self, budget: Budget | None) -> bool:
        """Its closing plan brought up to date for this step within `budget`; False: not yet (it sits the
        iteration out, the planning goes on at the next)."""
        return self.closing is None or self.matcher is None or self.closing.prepare(
            self.matcher, self.lex, self.vocab.tables, self.tokens, budget)

    def narrow(self, row: np.ndarray) -> None:
        """Take this step's mask (row: its int32 words, the grammar's mask) further: near the end of
        the budget to the plan's next token (alone once it must be, before that beside the tokens
        that open nothing: a value string's text, a number's digits), and to numbers within max_digits."""
        tables, lex = self.vocab.tables, self.lex
        step = None if self.closing is None or self.matcher is None else self.closing.next(self.matcher, lex, tables, self.tokens)
        if step is not None:
            if step[1] or lex.in_string and lex.key:   # a key's text picks the member: it may open more
                row[:] = 0
            else:
                row &= tables.calm[int(lex.in_string)]
            row.view(np.uint32)[step[0] // 32] |= np.uint32(1 << (step[0] % 32))
        if self.max_digits and not lex.in_string:
            bounded = row & tables.digit_masks(self.max_digits)[min(max(lex.digits, 0), self.max_digits)]
            if bounded.any():
                row[:] = bounded

    def fork(self) -> "Grammar":
        """A copy to advance by a draft's tokens (speculative decoding), leaving this one as it is."""
        assert self.matcher is not None
        closing = None if self.closing is None else self.closing.copy()
        return replace(self, matcher=self.matcher.deep_copy(), lex=self.lex.copy(), closing=closing)

    def mask(self) -> bytes:
        """This step's allowed-token bitmask, narrowed: one row (`fill_masks` computes a plan's rows at once)."""
        assert self.matcher is not None
        row = np.zeros(-(-self.vocab.size // 32), np.int32)
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.narrow(row)
        return row.tobytes()

    def accept(self, token: int) -> str | None:
        """Advance by the request's new token: "stop" when the grammar is complete and can take
        nothing more, "error" when the token breaks it (the mask was not applied), else None."""
        m = self.matcher
        if m is None or not m.consume_token(token):
            return "error"
        self.tokens += 1
        if token < len(self.vocab.tables.token_bytes):
            self.lex.feed(self.vocab.tables.token_bytes[token])
        if self.closing is not None:
            self.closing.accepted(token, self.vocab.tables)
        if m.is_stopped():
            self.complete = m.is_accepting()
            return "stop"
        return None

    def release(self) -> None:
        """The request finished: note whether its output matches, and drop the matcher."""
        if self.matcher is not None:
            self.complete = self.complete or self.matcher.is_accepting()
            self.matcher = None

    def report(self) -> dict[str, Any]:
        """For the request's final metrics: a request cut by max_tokens says its output is incomplete."""
        return {"constraint": self.kind, "complete": self.complete, "tokens": self.tokens}
