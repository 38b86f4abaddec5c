"""FastServe's profiler: iteration time of the loaded model, measured once at start-up.

LLM inference is *semi* information-agnostic: output lengths are unknown, but an iteration's
time is predictable from its shape. The initiation iteration grows about linearly with the input
length; an increment iteration barely grows with the batch. The skip-join MLFQ uses the first
to place a new job and the second for Q1's quantum and for demotion.

`profile_engine` times synthetic plans through whatever executes them (a ModelRunner offline, the
whole worker pipeline when served); `IterationProfile` interpolates the measured points
piecewise-linearly and travels as a plain dict (a message, a JSON cache file).
"""
from __future__ import annotations

import json
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_mq.iteration import IterationPlan, SeqWork

if TYPE_CHECKING:
    from orca_mq.weights import ModelInfo

Points = list[tuple[int, float]]   # (x, seconds), x increasing
INCREMENT_CONTEXT = 64             # KV length of each request in the increment probes
PROBE_TOKEN = 100                  # any id in the vocabulary


def _interpolate(points: Points, x: float) -> float:
    """Piecewise-linear through the points; the end segments extend beyond them (never below 0)."""
    if len(points) == 1:
        return points[0][1]
    i = min(max(bisect_left([p[0] for p in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _monotone(samples: dict[int, list[float]]) -> Points:
    """Median per x, made non-decreasing: a longer input or a bigger batch is never predicted faster
    (measurement noise on a shared machine would otherwise reorder skip-join queues)."""
    points, top = [], 0.0
    for x in sorted(samples):
        top = max(top, statistics.median(samples[x]))
        points.append((x, top))
    return points


@dataclass(slots=True)
class IterationProfile:
    initiation: Points   # (input tokens, s) of an iteration running one initiation request
    increment: Points    # (batch size, s) of an iteration of increment requests

    def initiation_time(self, n_tokens: int) -> float:
        return _interpolate(self.initiation, n_tokens)

    def increment_time(self, batch_size: int) -> float:
        return _interpolate(self.increment, batch_size)

    @classmethod
    def fit(cls, initiation: dict[int, list[float]], increment: dict[int, list[float]]) -> "IterationProfile":
        if not initiation or not increment:
            raise ValueError("a profile needs at least one initiation and one increment measurement")
        return cls(_monotone(initiation), _monotone(increment))

    @classmethod
    def estimate(cls, info: "ModelInfo", dtype: str) -> "IterationProfile":
        """A stand-in until a measured profile is set: a roofline of a modest CPU (weights read once
        per iteration at 10 GB/s, 2 FLOPs per weight per token at 50 GFLOP/s)."""
        h, d = info.hidden_size, info.head_dim
        params = info.n_layers * (2 * h * info.n_heads * d + 2 * h * info.n_kv_heads * d + 3 * h * info.intermediate_size)
        params += info.vocab_size * h
        read = params * (4 if dtype == "float32" else 2) / 10e9
        per_token = 2 * params / 50e9
        return cls([(1, read + per_token), (4096, read + 4096 * per_token)], [(1, read + per_token), (256, read + 256 * per_token)])

    def to_dict(self) -> dict[str, Any]:
        return {"initiation": [list(p) for p in self.initiation], "increment": [list(p) for p in self.increment]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "IterationProfile":
        return cls([(int(x), float(t)) for x, t in d["initiation"]], [(int(x), float(t)) for x, t in d["increment"]])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> "IterationProfile":
        return cls.from_dict(json.loads(Path(path).read_text()))


def probe_plans(block_size: int, num_blocks: int, max_len: int, max_bs: int) -> Iterator[tuple[str, int, IterationPlan]]:
    """Synthetic iterations to time: ("initiation", input length, plan) for lengths 1, 16, 32, 64, ...
    up to max_len, and ("increment", batch size, plan) for 1, 2, 4, ... max_bs requests, all within
    a KV pool of num_blocks blocks. They write garbage into blocks that no request owns yet, so they
    must run before any request. Iteration numbers are negative: they never collide with a scheduler's."""
    max_len = min(max_len, num_blocks * block_size)
    lengths = sorted({1, max_len, *(n for n in (16 << i for i in range(16)) if n < max_len)})
    per_req = -(-(INCREMENT_CONTEXT + 1) // block_size)
    sizes = sorted({min(max_bs, num_blocks // per_req), *(b for b in (1 << i for i in range(16)) if b < max_bs)})
    n = 0
    for length in lengths:
        n -= 1
        yield "initiation", length, IterationPlan(n, [SeqWork("probe", [PROBE_TOKEN] * length, 0, list(range(-(-length // block_size))))])
    for b in (s for s in sizes if s >= 1):
        n -= 1
        seqs = [SeqWork(f"probe{i}", [PROBE_TOKEN], INCREMENT_CONTEXT, list(range(i * per_req, (i + 1) * per_req)))
                for i in range(b)]
        yield "increment", b, IterationPlan(n, seqs)


def profile_engine(run: Callable[[IterationPlan], Any], block_size: int, num_blocks: int, max_len: int, max_bs: int,
                   repeats: int = 3) -> IterationProfile:
    """Time every probe plan `repeats` times (after one untimed warm-up pass) through `run`, which
    must return once the iteration is done (e.g. `ModelRunner.execute`)."""
    samples: dict[str, dict[int, list[float]]] = {"initiation": {}, "increment": {}}
    probes = list(probe_plans(block_size, num_blocks, max_len, max_bs))
    for rep in range(repeats + 1):
        for kind, x, plan in probes:
            t0 = time.perf_counter()
            run(plan)
            if rep:
                samples[kind].setdefault(x, []).append(time.perf_counter() - t0)
    return IterationProfile.fit(samples["initiation"], samples["increment"])
