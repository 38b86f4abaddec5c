"""The table of a request's sampling fields, each stated once: its type, bounds, default and meaning.

Everything that checks or shows a sampling field follows from it: SamplingParams' defaults and
validation (the frontend's admission, the ZeroMQ client's check before sending, the offline LLM),
the HTTP schemas' fields (completions, chat, the Responses and Messages views: orca_mq.api.fields,
where a view may narrow or widen a bound as its API says), the README's field reference (`markdown`) and the test
that checks all of them at and just past every bound (tests/test_sampling_fields.py). The bounds
keep what a request asks for servable: msgpack ints are 64-bit, torch seeds uint64, sampling runs
in float32. The greedy rule lives here too: every place that asks whether a row samples calls `is_greedy`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, TypeVar

from orca_mq.short_repr import short_repr

INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 100.0          # a logit_bias value in [-100, 100], as OpenAI's
MAX_LOGIT_BIAS_ENTRIES = 4096   # the most a server may allow (model.max_logit_bias; its plans carry them every iteration)


@dataclass(frozen=True, slots=True)
class SamplingField:
    """One field: a number or boolean with bounds (inclusive; `low_open`: low excluded; `zero`: 0
    also, below `low`; `nullable`: null = its default), or a list / map whose entries its own check
    bounds (`high`: how many)."""

    name: str
    kind: type
    default: Any
    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    zero: bool = False
    nullable: bool = False

    @property
    def scalar(self) -> bool:
        return self.kind in (int, float, bool)

    def accepts(self, v: Any) -> bool:
        if v is None:
            return self.nullable
        if self.kind is bool:
            return isinstance(v, bool)
        if isinstance(v, bool) or not isinstance(v, int if self.kind is int else (int, float)):
            return False
        if self.kind is float and not math.isfinite(v):
            return False
        assert self.low is not None and self.high is not None
        return (self.zero and v == 0) or ((v > self.low if self.low_open else v >= self.low) and v <= self.high)

    def describe(self) -> str:
        """What it accepts, in words: "an integer in [1, 2147483647] or null", "0 (greedy) or a number in ..."."""
        if self.kind is bool:
            return "a boolean"
        what = f"{'an integer' if self.kind is int else 'a number'} in {'(' if self.low_open else '['}{self.low}, {self.high}]"
        return ("0 (greedy) or " if self.zero else "") + what + (" or null" if self.nullable else "")

    def problem(self, v: Any) -> str | None:
        """None if it accepts v, else the refusal's text (which names the field)."""
        return None if self.accepts(v) else f"{self.name} must be {self.describe()}, got {short_repr(v)}"

    def bounded(self, low: float | None = None, high: float | None = None) -> "SamplingField":
        """The field as an API that states other bounds takes it (Messages' temperature: [0, 1])."""
        return dataclasses.replace(self, low=self.low if low is None else low, high=self.high if high is None else high)

    def row(self) -> str:
        """Its line of the README's table."""
        kind = {int: "integer", float: "number", bool: "boolean", list: "list", dict: "map"}[self.kind]
        bounds = self.describe() if self.scalar and self.kind is not bool else "—"
        default = "null" if self.default is None else str(self.default).lower() if self.kind is bool else repr(self.default)
        return f"| `{self.name}` | {kind} | {bounds} | `{default}` | {self.doc} |"


FIELDS: dict[str, SamplingField] = {f.name: f for f in (
    SamplingField("max_tokens", int, 16, "tokens to generate at most; null: the rest of the context (resolved at "
                  "admission)", 1, INT32_MAX, nullable=True),
    SamplingField("temperature", float, 1.0, "0: greedy; below 0.001 float32 logits / temperature overflow",
                  1e-3, 100.0, zero=True),
    SamplingField("top_k", int, 0, "after min_p, sample among the k most likely tokens (and any as likely as the "
                  "k-th); 0 (or more than the vocabulary): off; 1: greedy", 0, INT32_MAX),
    SamplingField("top_p", float, 1.0, "after top_k, among the most likely whose probability (over what top_k kept) "
                  "reaches p, and any as likely as the last; 1: off", 0, 1, low_open=True),
    SamplingField("min_p", float, 0.0, "vLLM's: a sampled row drops tokens less likely than min_p x its most likely",
                  0.0, 1.0),
    SamplingField("seed", int, None, "a seeded draw depends only on the seed and the position, whatever the batch",
                  0, INT64_MAX, nullable=True),
    SamplingField("presence_penalty", float, 0.0, "OpenAI's: minus this where a token was generated so far",
                  -2.0, 2.0),
    SamplingField("frequency_penalty", float, 0.0, "OpenAI's: minus this times how often a token was generated so far",
                  -2.0, 2.0),
    SamplingField("repetition_penalty", float, 1.0, "transformers' / vLLM's: a prompt or generated token's logit "
                  "/ p (positive) or x p; 1: off", 0.01, 100.0),
    SamplingField("min_tokens", int, 0, "vLLM's: EOS (unless ignore_eos) and stop_token_ids masked until this many "
                  "are generated; at most max_tokens", 0, INT32_MAX),
    SamplingField("ignore_eos", bool, False, "generate past EOS and stop_token_ids, to max_tokens"),
    SamplingField("skip_special_tokens", bool, True, "special tokens are left out of the text"),
    SamplingField("logprobs", int, None, "each sampled token's log probability and its k most likely (0: its own "
                  "only); the server bounds k (model.max_logprobs)", 0, INT32_MAX, nullable=True),
    SamplingField("prompt_logprobs", int, None, "the same for every prompt token after the first (no prefix cache "
                  "then)", 0, INT32_MAX, nullable=True),
    SamplingField("stop_token_ids", list, [], f"token ids that end the request (at most {MAX_STOP_TOKEN_IDS}, each in "
                  "the vocabulary)", high=MAX_STOP_TOKEN_IDS),
    SamplingField("logit_bias", dict, {}, f"OpenAI's: token id -> bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] "
                  "added to its logit (at most the server's model.max_logit_bias entries)", high=MAX_LOGIT_BIAS_ENTRIES),
    SamplingField("structured_outputs", dict, None, "the output matches a JSON schema, regex, choice or grammar "
                  "(see Structured outputs)"),
)}
SCALARS = [f for f in FIELDS.values() if f.scalar]
# the entries of the list and map fields (logit_bias' keys are token ids as decimal strings)
TOKEN_ID = SamplingField("token id", int, 0, "a stop_token_ids or logit_bias entry", 0, INT32_MAX)
BIAS = SamplingField("bias", float, 0.0, "a logit_bias value", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)



def min_tokens_problem(min_tokens: int, max_tokens: int | None) -> str | None:
    """The one rule between two fields: min_tokens at most max_tokens (None: the rest of the context,
    checked at admission against what is left)."""
    if max_tokens is None or min_tokens <= max_tokens:
        return None
    return f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})"


Row = TypeVar("Row")


def is_greedy(temperature: Row, top_k: Row) -> Row:
    """Whether a row takes its most likely token instead of drawing one: temperature 0 or top_k 1. The
    one rule, for a request's params (floats) and a plan's columns (numpy arrays) alike."""
    return (temperature == 0) | (top_k == 1)  # type: ignore[operator, return-value]


def markdown() -> str:
    """The README's table of the sampling fields (tests/test_sampling_fields.py keeps it current)."""
    head = ["| field | type | accepted | default | meaning |", "|---|---|---|---|---|"]
    return "\n".join(head + [f.row() for f in FIELDS.values()])


if __name__ == "__main__":   # the README's table: python -m orca_mq.protocol.sampling_fields
    print(markdown())
