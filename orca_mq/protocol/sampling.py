"""Per-request sampling parameters and their validation: the wire type of a request's `sampling`
(a client's Generate, the frontend's AddRequest), so it lives with the protocol.

Validation bounds every field, so that what it accepts cannot fail later in the sampler or on
the wire (msgpack ints are 64-bit; torch seeds are uint64; sampling runs in float32). The bounds
are constants here so that the HTTP API's schema states the same ones.

The frontend parses and validates a request's params once, resolves `max_tokens=None` (the rest
of the context) once the prompt is tokenized (orca_mq.admission), and carries the typed
object to the scheduler inside AddRequest.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from orca_mq.errors import InvalidRequest
from orca_mq.short_repr import short_repr
from orca_mq.protocol.structured import StructuredOutputsParams

INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1
MIN_TEMPERATURE = 1e-3      # below it float32 logits / temperature overflow: use 0 for greedy
MAX_TEMPERATURE = 100.0
MAX_STOP_TOKEN_IDS = 1024


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16   # None = the rest of the context, resolved at admission
    temperature: float = 1.0      # 0 = greedy
    top_k: int = 0                # 0 = off; larger than the vocabulary = off
    top_p: float = 1.0
    seed: int | None = None       # per-request seed: same seed, same tokens, whatever the batch
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None  # the output matches a JSON schema, regex, choice or grammar

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:  # a dict from the wire or the offline API
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"invalid sampling params: {msg}")

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX):
            raise bad(f"max_tokens must be an integer in [1, {INT32_MAX}] or null, got {short_repr(self.max_tokens)}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                raise bad(f"{name} must be a finite number, got {short_repr(v)}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise bad(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise bad(f"top_k must be an integer in [0, {INT32_MAX}], got {short_repr(self.top_k)}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= INT64_MAX):
            raise bad(f"seed must be an integer in [0, {INT64_MAX}], got {short_repr(self.seed)}")
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be a boolean, got {short_repr(self.ignore_eos)}")
        limit = INT32_MAX if vocab_size is None else vocab_size - 1
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            _is_int(t) and 0 <= t <= limit for t in self.stop_token_ids
        ):
            raise bad(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids in the vocabulary "
                      f"[0, {limit}], got {short_repr(self.stop_token_ids)}")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"invalid sampling params: unknown field(s) {short_repr(sorted(map(str, unknown)))}")
        return cls(**data)
