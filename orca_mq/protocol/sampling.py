"""Per-request sampling parameters and their validation: the wire type of a request's `sampling`
(a client's Generate, the frontend's AddRequest), so it lives with the protocol.

Each field's type, bounds, default and meaning are the table's (orca_mq.protocol.sampling_fields),
which the HTTP API's schemas follow too; validation bounds every field, so that what it accepts
cannot fail later in the sampler or on the wire, and a refusal names its field (InvalidRequest.param).

The frontend parses and validates a request's params once, resolves `max_tokens=None` (the rest
of the context) once the prompt is tokenized (orca_mq.admission), and carries the typed
object to the scheduler inside AddRequest.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from orca_mq.errors import InvalidRequest
from orca_mq.short_repr import short_repr
from orca_mq.protocol.sampling_fields import (BIAS, FIELDS, INT32_MAX, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS,
                                              SCALARS, TOKEN_ID, min_tokens_problem)
from orca_mq.protocol.structured import StructuredOutputsParams

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(msg: str, param: str) -> InvalidRequest:
    return InvalidRequest(f"invalid sampling params: {msg}", param)


def _default(name: str) -> Any:
    return FIELDS[name].default


@dataclass(slots=True)
class SamplingParams:
    # the table's fields (orca_mq.protocol.sampling_fields: each one's bounds and meaning), its defaults
    max_tokens: int | None = _default("max_tokens")   # None = the rest of the context, resolved at admission
    temperature: float = _default("temperature")      # 0 = greedy
    top_k: int = _default("top_k")
    top_p: float = _default("top_p")
    seed: int | None = _default("seed")
    ignore_eos: bool = _default("ignore_eos")
    stop_token_ids: list[int] = field(default_factory=list)
    # the logits processors (orca_mq/engine/history.py); every default is a no-op that costs nothing
    presence_penalty: float = _default("presence_penalty")
    frequency_penalty: float = _default("frequency_penalty")
    repetition_penalty: float = _default("repetition_penalty")
    min_tokens: int = _default("min_tokens")
    min_p: float = _default("min_p")
    logit_bias: dict[str, float] = field(default_factory=dict)  # token id (a decimal string; an int offline) -> bias
    structured_outputs: StructuredOutputsParams | None = None
    logprobs: int | None = _default("logprobs")
    prompt_logprobs: int | None = _default("prompt_logprobs")
    skip_special_tokens: bool = _default("skip_special_tokens")   # the frontend's detokenizer

    def __post_init__(self) -> None:
        if self.logit_bias is None:   # as vLLM's: null = none
            self.logit_bias = {}
        elif isinstance(self.logit_bias, dict):   # offline: {token_id: bias}; on the wire keys are strings (JSON, msgpack maps)
            self.logit_bias = {str(k) if _is_int(k) else k: v for k, v in self.logit_bias.items()}
        if self.structured_outputs is not None:  # a dict from the wire or the offline API
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    def validate(self, vocab_size: int | None = None) -> None:
        for f in SCALARS:
            if f.name not in ("logprobs", "prompt_logprobs") and (problem := f.problem(getattr(self, f.name))):
                raise _bad(problem, f.name)
        if problem := min_tokens_problem(self.min_tokens, self.max_tokens):
            raise _bad(problem, "min_tokens")
        limit = INT32_MAX if vocab_size is None else vocab_size - 1
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            TOKEN_ID.accepts(t) and t <= limit for t in self.stop_token_ids
        ):
            raise _bad(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids in the vocabulary "
                       f"[0, {limit}], got {short_repr(self.stop_token_ids)}", "stop_token_ids")
        self.validate_logit_bias(MAX_LOGIT_BIAS_ENTRIES, limit)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        self.validate_logprobs(INT32_MAX)

    def validate_logprobs(self, max_logprobs: int) -> None:
        """logprobs / prompt_logprobs: null or an integer in [0, max_logprobs] (admission checks the
        server's model.max_logprobs; validate() alone only that they are counts)."""
        for name in ("logprobs", "prompt_logprobs"):
            if problem := FIELDS[name].bounded(high=max_logprobs).problem(getattr(self, name)):
                raise _bad(problem, name)

    def validate_logit_bias(self, max_entries: int, last_token: int = INT32_MAX) -> None:
        """logit_bias: at most `max_entries` token ids (admission checks the server's model.max_logit_bias,
        validate() the absolute bound), each a canonical decimal id in [0, last_token], each bias a
        number in [-100, 100]."""
        lb = self.logit_bias
        if not isinstance(lb, dict) or len(lb) > max_entries:
            raise _bad(f"logit_bias must map at most {max_entries} token ids to biases, got {short_repr(lb)}", "logit_bias")
        for k, v in lb.items():
            if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 and str(int(k)) == k
                    and int(k) <= last_token):
                raise _bad(f"logit_bias keys must be token ids in [0, {last_token}], got {short_repr(k)}", "logit_bias")
            if not BIAS.accepts(v):
                raise _bad(f"logit_bias values must be numbers in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got "
                           f"{short_repr(v)} for token {k}", "logit_bias")

    @property
    def penalized(self) -> bool:
        """Its logits depend on its own tokens so far: the last stage keeps their history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """It asks for any logits processor (a plan row then carries its RowExtras)."""
        return self.penalized or self.min_tokens > 0 or self.min_p > 0 or bool(self.logit_bias)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"invalid sampling params: unknown field(s) {short_repr(sorted(map(str, unknown)))}")
        return cls(**data)
