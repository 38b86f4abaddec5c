"""Synthetic request traces of the two papers' end-to-end evaluations.

* ``orca`` (ORCA §6.2): Poisson arrivals at ``rate`` req/s, input length ~ U(input_len),
  ``max_tokens`` ~ U(output_len) (the paper: U(32, 512) and U(1, 128), both inclusive), generation
  forced to ``max_tokens`` (``ignore_eos``).
* ``fastserve`` (FastServe §6): a Gamma arrival process with mean inter-arrival 1/rate and
  coefficient of variation ``cv`` (shape k = 1/cv², scale = 1/(rate·k); cv = 0 is the
  deterministic limit, every gap exactly 1/rate); input and output lengths from a bounded Zipf law
  with exponent θ over each range [lo, hi]:

      P(len = lo + i) = (i + 1)^-θ / Σ_{j=0}^{hi-lo} (j + 1)^-θ,   i = 0 .. hi - lo

  so the shortest length is the most frequent, frequencies decrease with length, θ = 0 is the
  uniform law and a larger θ is more skewed.

Arrival times are relative to the start of the run and the first request arrives at t = 0
(n - 1 gaps are drawn); ``rate`` = inf or 0 means every request arrives at t = 0.

Prompts are real text: a token-id corpus (see :func:`load_corpus`) is read as a ring, and request
i takes the ``input_len[i]`` tokens that follow request i-1's window, the first window starting at
a random offset. Windows are therefore distinct until the corpus wraps around, and with a
different alignment after that. The prompt builder takes plain token ids, so tests need no
tokenizer.

Chat-shaped traces (issue 22: prefix caching):

* ``chat``: ``num_requests`` requests, each one of ``system_prompts`` shared system prompts of
  ``system_len`` tokens, chosen with bounded-Zipf popularity θ = ``zipf`` (prompt 0 the most
  popular: P(i) ∝ (i + 1)^-θ), followed by a unique user turn of U(input_len) tokens; max_tokens
  ~ U(output_len); arrivals as the orca trace (Gamma at ``cv``; 1 is Poisson).
* ``multiturn``: ``num_requests`` conversations of ``turns`` turns, each opened by a system prompt
  chosen as above (none when ``system_prompts`` = 0). Conversations start as the requests of
  ``chat`` do; turn k + 1 is sent ``think_s`` seconds after turn k's final message, and its
  prompt is the conversation so far: turn k's prompt + the answer the server gave + a new user
  message. The answer is only known then, so the trace holds what each turn adds
  (:class:`ChatTurn`) and the replayer builds the prompt (:mod:`orca_mq.bench.replay`).

Chat prompts are chat messages of text (the server applies its chat template), so any OpenAI
server can be measured on them (`/v1/chat/completions`): the pieces are windows of the token
corpus as above, turned into text by the caller's ``decode`` (the bench's tokenizer), so a piece
of L tokens reads back as about L tokens, and equal pieces are equal strings. System prompts and
user turns are one run of consecutive windows, so they are all distinct (until the corpus wraps).

Everything random comes from one ``numpy.random.Generator(PCG64(seed))`` drawn in a fixed order:
input lengths, output lengths, corpus offset, then the arrival process (chat traces draw each
conversation's system prompt first). So the same seed and arguments give the same trace whatever
policy is measured, and, as in ORCA §6.2 ("change the
Poisson parameter and adjust the request arrival time accordingly"), changing only the rate keeps
the very same requests and scales their arrival times by old_rate / new_rate (gaps are unit-rate
draws divided by the rate; the same holds for the Gamma trace at a fixed CV).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

TRACE_KINDS = ("orca", "fastserve")     # open loop, token-id prompts: make_trace
CHAT_KINDS = ("chat", "multiturn")      # chat messages, conversations closed loop: make_chat_trace

# Paper defaults for the ORCA trace; the FastServe trace uses the same ranges unless told otherwise.
DEFAULT_INPUT_LEN = (32, 512)
DEFAULT_OUTPUT_LEN = (1, 128)
# The chat-shaped workload of issue 22: user turns (input_len) 24-96 tokens, answers 16-64.
CHAT_INPUT_LEN = (24, 96)
CHAT_OUTPUT_LEN = (16, 64)


def default_lengths(kind: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(input_len, output_len) ranges a trace kind uses unless told otherwise."""
    return (CHAT_INPUT_LEN, CHAT_OUTPUT_LEN) if kind in CHAT_KINDS else (DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN)


@dataclass(slots=True)
class TraceRequest:
    index: int
    arrival_s: float              # scheduled send time, seconds after the start of the run
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class ChatTurn:
    """One request of a chat trace: what a conversation's turn adds to it. Its prompt, built when it
    is sent, is every earlier message of the conversation (answers included) + ``messages``."""
    index: int
    conversation: int
    turn: int                     # 0-based
    delay_s: float                # turn 0: send time after the start of the run; later: think time after turn-1 ends
    messages: list[dict[str, str]]  # turn 0: [system prompt if any, user]; later: [user]
    max_tokens: int
    system: int | None = None     # index of the shared system prompt it opens with (turn 0)


@dataclass(slots=True)
class TraceSpec:
    kind: str = "orca"
    num_requests: int = 100
    rate: float = 1.0             # req/s; inf or 0 = all at t = 0
    cv: float = 1.0               # CV of the Gamma inter-arrival gaps; the orca trace is Poisson at 1
    zipf: float = 1.0             # fastserve only (θ)
    input_len: tuple[int, int] = DEFAULT_INPUT_LEN
    output_len: tuple[int, int] = DEFAULT_OUTPUT_LEN
    seed: int = 0
    # chat kinds only (num_requests is the number of conversations of multiturn)
    system_prompts: int = 4       # shared system prompts (0 = none)
    system_len: int = 448         # tokens of each
    turns: int = 4                # multiturn: turns per conversation (chat: 1)
    think_s: float = 0.0          # multiturn: seconds from a turn's final message to the next turn

    def validate(self) -> None:
        if self.kind not in TRACE_KINDS + CHAT_KINDS:
            raise ValueError(f"trace must be one of {TRACE_KINDS + CHAT_KINDS}, got {self.kind!r}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if math.isnan(self.rate) or self.rate < 0:
            raise ValueError(f"rate must be >= 0 (0 or inf = all at once), got {self.rate}")
        if not (self.cv >= 0 and math.isfinite(self.cv)):
            raise ValueError(f"cv must be a finite number >= 0, got {self.cv}")
        if not (self.zipf >= 0 and math.isfinite(self.zipf)):
            raise ValueError(f"zipf theta must be a finite number >= 0, got {self.zipf}")
        for name, (lo, hi) in (("input_len", self.input_len), ("output_len", self.output_len)):
            if not (1 <= lo <= hi):
                raise ValueError(f"{name} must be MIN:MAX with 1 <= MIN <= MAX, got {lo}:{hi}")
        if self.system_prompts < 0 or self.system_len < 1 or self.turns < 1:
            raise ValueError(f"need system_prompts >= 0, system_len >= 1, turns >= 1, got "
                             f"{self.system_prompts}, {self.system_len}, {self.turns}")
        if not (self.think_s >= 0 and math.isfinite(self.think_s)):
            raise ValueError(f"think_s must be a finite number >= 0, got {self.think_s}")


# ---------------------------------------------------------------- distributions

def _all_at_once(rate: float) -> bool:
    return rate == 0 or math.isinf(rate)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Arrival times of a Poisson process (exponential gaps, mean 1/rate), first arrival at 0."""
    if _all_at_once(rate):
        return np.zeros(n)
    gaps = rng.standard_exponential(size=n - 1) / rate
    return np.concatenate([[0.0], np.cumsum(gaps)])


def gamma_arrivals(rng: np.random.Generator, n: int, rate: float, cv: float) -> np.ndarray:
    """Arrival times of a Gamma renewal process: gaps ~ Gamma(k = 1/cv², θ = 1/(rate·k)).

    Mean gap 1/rate, std/mean = cv; cv = 1 is Poisson, cv = 0 deterministic gaps of 1/rate.
    """
    if _all_at_once(rate):
        return np.zeros(n)
    if cv == 0:
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.standard_gamma(shape, size=n - 1) / (rate * shape)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def uniform_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    """Integers uniform on [lo, hi], both inclusive."""
    return rng.integers(lo, hi, size=n, endpoint=True)


def zipf_pmf(lo: int, hi: int, theta: float) -> np.ndarray:
    """P(lo + i) ∝ (i + 1)^-θ for i = 0 .. hi - lo (bounded Zipf; θ = 0 is uniform)."""
    ranks = np.arange(1, hi - lo + 2, dtype=np.float64)
    w = ranks ** -theta
    return w / w.sum()


def zipf_lengths(rng: np.random.Generator, n: int, lo: int, hi: int, theta: float) -> np.ndarray:
    """Integers on [lo, hi] from the bounded Zipf law of :func:`zipf_pmf`."""
    return lo + rng.choice(hi - lo + 1, size=n, p=zipf_pmf(lo, hi, theta))


# ---------------------------------------------------------------- prompts

def build_prompts(rng: np.random.Generator, corpus: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """Consecutive windows of a token-id ring, one of each length, starting at a random offset."""
    ids = np.asarray(corpus, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("the prompt corpus must be a non-empty sequence of token ids")
    n = ids.size
    pos = int(rng.integers(0, n))
    prompts = []
    for length in lengths:
        length = int(length)
        idx = (pos + np.arange(length)) % n
        prompts.append(ids[idx].tolist())
        pos = (pos + length) % n
    return prompts


def load_corpus(tokenizer: Any) -> list[int]:
    """Token ids of English text that ships with Python (pydoc_data.topics), in sorted topic order.

    Special tokens (BOS/EOS/chat markers) are removed so a prompt never contains one.
    """
    from pydoc_data.topics import topics

    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    sep = tokenizer.encode("\n\n", add_special_tokens=False)
    out: list[int] = []
    for key in sorted(topics):
        out.extend(tokenizer.encode(topics[key], add_special_tokens=False))
        out.extend(sep)
    out = [t for t in out if t not in special]
    if not out:
        raise RuntimeError("the tokenizer produced an empty corpus")
    return out


# ---------------------------------------------------------------- the trace

def make_trace(spec: TraceSpec, corpus: Sequence[int]) -> list[TraceRequest]:
    spec.validate()
    if spec.kind in CHAT_KINDS:
        raise ValueError(f"a {spec.kind} trace is chat messages: make_chat_trace")
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    n = spec.num_requests
    # lengths and prompts first, arrivals last: a different rate (or CV) keeps the same requests
    if spec.kind == "orca":
        in_lens = uniform_lengths(rng, n, *spec.input_len)
        out_lens = uniform_lengths(rng, n, *spec.output_len)
    else:
        in_lens = zipf_lengths(rng, n, *spec.input_len, spec.zipf)
        out_lens = zipf_lengths(rng, n, *spec.output_len, spec.zipf)
    prompts = build_prompts(rng, corpus, in_lens)
    if spec.kind == "orca" and spec.cv == 1.0:   # another CV (bench --burstiness) makes it a Gamma process
        arrivals = poisson_arrivals(rng, n, spec.rate)
    else:
        arrivals = gamma_arrivals(rng, n, spec.rate, spec.cv)
    return [
        TraceRequest(index=i, arrival_s=float(arrivals[i]), prompt_token_ids=prompts[i], max_tokens=int(out_lens[i]))
        for i in range(n)
    ]


def make_chat_trace(spec: TraceSpec, corpus: Sequence[int], decode: Callable[[list[int]], str]) -> list[ChatTurn]:
    """The turns of a chat / multiturn trace, conversation by conversation (see the module doc)."""
    spec.validate()
    if spec.kind not in CHAT_KINDS:
        raise ValueError(f"a {spec.kind} trace is token ids: make_trace")
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    n, turns = spec.num_requests, (spec.turns if spec.kind == "multiturn" else 1)
    k = spec.system_prompts
    opening = rng.choice(k, size=n, p=zipf_pmf(0, k - 1, spec.zipf)) if k else [None] * n
    in_lens = uniform_lengths(rng, n * turns, *spec.input_len)
    out_lens = uniform_lengths(rng, n * turns, *spec.output_len)
    pieces = build_prompts(rng, corpus, [spec.system_len] * k + list(in_lens))   # one run of windows: all distinct
    systems, users = pieces[:k], pieces[k:]
    starts = gamma_arrivals(rng, n, spec.rate, spec.cv)
    system_text = [decode(ids) for ids in systems]
    out: list[ChatTurn] = []
    for c in range(n):
        for t in range(turns):
            i = c * turns + t
            sys_i = None if opening[c] is None or t else int(opening[c])
            head = [] if sys_i is None else [{"role": "system", "content": system_text[sys_i]}]
            out.append(ChatTurn(index=i, conversation=c, turn=t,
                                delay_s=float(starts[c]) if t == 0 else spec.think_s,
                                messages=head + [{"role": "user", "content": decode(users[i])}],
                                max_tokens=int(out_lens[i]), system=sys_i))
    return out


def trace_stats(trace: Sequence[TraceRequest]) -> dict[str, float]:
    """A few numbers to record with the results, to see at a glance what was sent."""
    arr = np.array([r.arrival_s for r in trace])
    ins = np.array([r.input_len for r in trace])
    outs = np.array([r.max_tokens for r in trace])
    gaps = np.diff(arr)
    return {
        "duration_s": float(arr[-1] - arr[0]) if arr.size else 0.0,
        "offered_rate_req_s": float(gaps.size / (arr[-1] - arr[0])) if arr.size > 1 and arr[-1] > arr[0] else math.inf,
        "input_len_mean": float(ins.mean()),
        "output_len_mean": float(outs.mean()),
        "total_input_tokens": int(ins.sum()),
        "total_output_tokens": int(outs.sum()),
    }


def chat_stats(trace: Sequence[ChatTurn]) -> dict[str, Any]:
    """What a chat trace sends, by the generator's count (the servers' token counts come with the results)."""
    uses: dict[int, int] = {}
    for t in trace:
        if t.system is not None:
            uses[t.system] = uses.get(t.system, 0) + 1
    return {"requests": len(trace), "conversations": len({t.conversation for t in trace}),
            "system_prompt_uses": [uses.get(i, 0) for i in range(max(uses, default=-1) + 1)],
            "output_len_mean": float(np.mean([t.max_tokens for t in trace])),
            "total_output_tokens": int(sum(t.max_tokens for t in trace))}


def parse_range(text: str) -> tuple[int, int]:
    """"MIN:MAX" (or a single N for N:N) -> (MIN, MAX)."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"expected MIN:MAX integers, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def spec_dict(spec: TraceSpec) -> dict[str, Any]:
    d = asdict(spec)
    d["input_len"] = list(spec.input_len)
    d["output_len"] = list(spec.output_len)
    return d
