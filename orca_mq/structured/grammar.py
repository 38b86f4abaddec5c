"""One request's grammar state: an llguidance matcher advanced by the request's accepted tokens.

It lives on the scheduler's Request, so FastServe's preemption and KV offload leave it as it is.
EOS is allowed by the mask only where the grammar accepts; a grammar that can take nothing more
(or has taken EOS) ends its request with "stop".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
from llguidance import LLExecutor, LLMatcher, LLTokenizer

LIMITS = llguidance.LLParserLimits(verbose_errors=False)   # llguidance's default work bounds; errors without the grammar dump


@dataclass(slots=True)
class Vocabulary:
    """The model's tokens as llguidance sees them, shared by every grammar of a process, and the
    executor that computes an iteration's masks."""
    tokenizer: LLTokenizer
    size: int                           # the logits' width: a mask has one bit per token
    executor: LLExecutor

    @classmethod
    def of(cls, hf_tokenizer: Any, size: int, eos_token_ids: list[int], threads: int) -> "Vocabulary":
        tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=size, eos_token=list(eos_token_ids))
        return cls(tok, size, LLExecutor(threads or None))


@dataclass(slots=True)
class Grammar:
    kind: str
    matcher: LLMatcher | None          # None once released
    vocab: Vocabulary
    tokens: int = 0                    # tokens accepted
    complete: bool = False             # the output so far matches the constraint whole

    def accept(self, token: int) -> str | None:
        """Advance by the request's new token: "stop" when the grammar is complete and can take
        nothing more, "error" when the token breaks it (the mask was not applied), else None."""
        m = self.matcher
        if m is None or not m.consume_token(token):
            return "error"
        self.tokens += 1
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
