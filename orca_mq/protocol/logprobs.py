"""Log probabilities of tokens under the model, as they travel: from the last stage (ids and
numbers) to the frontend, and from the frontend to clients (with each token's text).

Values are the model's own distribution as vLLM returns them by default: log_softmax of the raw
logits in float32, before temperature, top-k/top-p, penalties and a grammar's mask. A position's
entry is the log probability of its token (the one sampled, or the prompt's next token) and its
`k` most likely tokens, most likely first (k = the request's `logprobs` / `prompt_logprobs`).

Columns, one entry per position: a `TokenLogprobs` of several positions is one request's share of
one message (an iteration's new token, or a prompt's positions).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    """Positions' tokens and their log probabilities (engine side: ids only)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)          # per position, most likely first
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: "TokenLogprobs") -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class Logprobs:
    """What a client gets: a TokenLogprobs with each token's text (the id decoded alone, as vLLM
    shows it); a prompt's first position has no log probability (None) and no alternatives."""

    token_ids: list[int] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_tokens: list[list[str]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: "Logprobs") -> None:
        for name in self.__slots__:   # type: ignore[attr-defined]
            getattr(self, name).extend(getattr(other, name))

    def consistent(self) -> bool:
        """Every column as long as the positions, each position's alternatives paired (a frame from
        the wire is checked with this before use)."""
        n = len(self.token_ids)
        return all(len(getattr(self, c)) == n for c in self.__slots__) and all(  # type: ignore[attr-defined]
            len(i) == len(t) == len(v) for i, t, v in zip(self.top_ids, self.top_tokens, self.top_logprobs))

    def top(self, i: int) -> dict[str, float]:
        """Position i's alternatives as {text: logprob} (the legacy completions format), most likely first."""
        return dict(zip(self.top_tokens[i], self.top_logprobs[i]))

    @classmethod
    def decoded(cls, lp: TokenLogprobs, text: Callable[[int], str]) -> "Logprobs":
        """`lp` with each token's text (`text`: an id decoded alone)."""
        return cls(list(lp.token_ids), list(map(text, lp.token_ids)), list(lp.logprobs), list(lp.top_ids),
                   [list(map(text, top)) for top in lp.top_ids], list(lp.top_logprobs))

    @classmethod
    def prompt(cls, first: int, rest: TokenLogprobs | None, text: Callable[[int], str]) -> "Logprobs":
        """A prompt's: its first token (no log probability) then the positions the engine computed."""
        out = cls([first], [text(first)], [None], [[]], [[]], [[]])
        if rest is not None:
            out.extend(cls.decoded(rest, text))
        return out


def entries(lp: Logprobs | None) -> int:
    """Its log probabilities: one per position and one per alternative (the work and size of their JSON)."""
    return 0 if lp is None else len(lp) + sum(map(len, lp.top_ids))
