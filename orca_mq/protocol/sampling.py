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
MAX_PENALTY = 2.0           # presence / frequency penalty in [-2, 2], as OpenAI's
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0   # repetition_penalty: > 0 (vLLM's), bounded for float32
MAX_LOGIT_BIAS = 100.0      # a logit_bias value in [-100, 100], as OpenAI's
MAX_LOGIT_BIAS_ENTRIES = 4096   # the most a server may allow (model.max_logit_bias; its plans carry them every iteration)


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
    # the logits processors (orca_mq/engine/history.py); every default is a no-op that costs nothing
    presence_penalty: float = 0.0   # OpenAI's: minus this where a token was generated so far by this request
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often it was generated so far
    repetition_penalty: float = 1.0  # transformers'/vLLM's: a prompt or generated token's logit / p (positive) or * p
    min_tokens: int = 0             # vLLM's: EOS (unless ignore_eos) and stop_token_ids masked until this many are generated
    min_p: float = 0.0              # vLLM's: a sampled row drops tokens less likely than min_p x its most likely
    logit_bias: dict[str, float] = field(default_factory=dict)  # OpenAI's: token id (a decimal string; an int offline) -> bias added to its logit
    structured_outputs: StructuredOutputsParams | None = None  # the output matches a JSON schema, regex, choice or grammar
    logprobs: int | None = None         # each sampled token's log probability and its k most likely (0: its own only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (no prefix cache then)
    skip_special_tokens: bool = True    # vLLM's: special tokens are left out of the text (the frontend's detokenizer)

    def __post_init__(self) -> None:
        if self.logit_bias is None:   # as vLLM's: null = none
            self.logit_bias = {}
        elif isinstance(self.logit_bias, dict):   # offline: {token_id: bias}; on the wire keys are strings (JSON, msgpack maps)
            self.logit_bias = {str(k) if _is_int(k) else k: v for k, v in self.logit_bias.items()}
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
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a boolean, got {short_repr(getattr(self, name))}")
        limit = INT32_MAX if vocab_size is None else vocab_size - 1
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            _is_int(t) and 0 <= t <= limit for t in self.stop_token_ids
        ):
            raise bad(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids in the vocabulary "
                      f"[0, {limit}], got {short_repr(self.stop_token_ids)}")
        self._validate_processors(bad, INT32_MAX if vocab_size is None else vocab_size - 1)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        self.validate_logprobs(INT32_MAX)

    def validate_logprobs(self, max_logprobs: int) -> None:
        """logprobs / prompt_logprobs: null or an integer in [0, max_logprobs] (admission checks the
        server's model.max_logprobs; validate() alone only that they are counts)."""
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= max_logprobs):
                raise InvalidRequest(f"invalid sampling params: {name} must be an integer in [0, {max_logprobs}] "
                                     f"or null, got {short_repr(v)}")

    def _validate_processors(self, bad: Any, last_token: int) -> None:
        for name, low, high in (("presence_penalty", -MAX_PENALTY, MAX_PENALTY), ("frequency_penalty", -MAX_PENALTY, MAX_PENALTY),
                                ("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY), ("min_p", 0.0, 1.0)):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v) or not low <= v <= high:
                raise bad(f"{name} must be a number in [{low}, {high}], got {short_repr(v)}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT32_MAX:
            raise bad(f"min_tokens must be an integer in [0, {INT32_MAX}], got {short_repr(self.min_tokens)}")
        if _is_int(self.max_tokens) and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self.validate_logit_bias(MAX_LOGIT_BIAS_ENTRIES, last_token)

    def validate_logit_bias(self, max_entries: int, last_token: int = INT32_MAX) -> None:
        """logit_bias: at most `max_entries` token ids (admission checks the server's model.max_logit_bias,
        validate() the absolute bound), each a canonical decimal id in [0, last_token], each bias a
        number in [-100, 100]."""
        lb = self.logit_bias
        if not isinstance(lb, dict) or len(lb) > max_entries:
            raise InvalidRequest(f"invalid sampling params: logit_bias must map at most {max_entries} token ids to "
                                 f"biases, got {short_repr(lb)}")
        for k, v in lb.items():
            if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 and str(int(k)) == k
                    and int(k) <= last_token):
                raise InvalidRequest(f"invalid sampling params: logit_bias keys must be token ids in [0, {last_token}], "
                                     f"got {short_repr(k)}")
            if not _is_number(v) or not math.isfinite(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                raise InvalidRequest(f"invalid sampling params: logit_bias values must be numbers in "
                                     f"[{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {short_repr(v)} for token {k}")

    @property
    def penalized(self) -> bool:
        """Its logits depend on its own tokens so far: the last stage keeps their history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """It asks for any logits processor (a plan row then carries its RowExtras)."""
        return self.penalized or self.min_tokens > 0 or self.min_p > 0 or bool(self.logit_bias)

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
