"""Per-request sampling parameters and their validation (the frontend and the offline API share it)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


class InvalidRequest(ValueError):
    """A request that cannot be served as given; the message names the problem."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0      # 0 = greedy
    top_k: int = 0                # 0 = off
    top_p: float = 1.0
    seed: int | None = None       # per-request seed: same seed, same tokens, whatever the batch
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"invalid sampling params: {msg}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise bad(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (vocab_size is None or t < vocab_size)
            for t in self.stop_token_ids
        ):
            raise bad(f"stop_token_ids must be token ids in the vocabulary, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"invalid sampling params: unknown field(s) {sorted(unknown)}")
        return cls(**data)
