"""A request's speculation state (its n-gram index over its tokens, its k, its back-off) and the
server's counters: what orca_mq/sched/speculative.py proposes from and learns into, kept on the
scheduler's Request so it leaves with it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

@dataclass(slots=True)
class NgramIndex:
    """A request's tokens and, for each n, where each n-gram last ended (before the newest token), kept
    up to date as tokens are appended: a lookup costs a few dict probes, not a scan."""

    n_min: int
    n_max: int
    tokens: list[int] = field(default_factory=list)
    ends: list[dict[tuple[int, ...], int]] = field(default_factory=list)   # [n - n_min]: n-gram -> its last end
    indexed: int = 0                   # n-grams ending before this position are in `ends`

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n tokens, the longest n first."""
        toks = self.tokens
        if not self.ends:
            self.ends = [{} for _ in range(self.n_min, self.n_max + 1)]
        for end in range(self.indexed, len(toks) - 1):   # the newest token ends no earlier occurrence
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self.ends[n - self.n_min][tuple(toks[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, len(toks) - 1)
        for n in range(min(self.n_max, len(toks) - 1), self.n_min - 1, -1):
            end = self.ends[n - self.n_min].get(tuple(toks[-n:]))
            if end is not None:   # what followed it; past the newest token, the copy copies itself (a loop)
                draft = toks[end + 1:end + 1 + k]
                while len(draft) < k:
                    draft.append(draft[end + 1 + len(draft) - len(toks)])
                return draft
        return []


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its index, its current k, and its back-off after failed drafts."""

    index: NgramIndex
    k: int
    misses: int = 0          # drafts in a row that kept nothing
    wait: int = 0            # iterations to skip before proposing again
    drafts: int = 0          # verify rows it ran
    drafted: int = 0         # draft tokens proposed...
    accepted: int = 0        # ...and kept


@dataclass(slots=True)
class SpecCounters:
    """The server's totals (vLLM's spec_decode_num_drafts / num_draft_tokens / num_accepted_tokens)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [i]: drafts whose token i was accepted

    def stats(self) -> dict[str, Any]:
        return {"spec_drafts": self.drafts, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens, "spec_accepted_per_pos": list(self.accepted_per_pos)}
