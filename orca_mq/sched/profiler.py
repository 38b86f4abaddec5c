"""FastServe's profiler: iteration time of the loaded model, measured once at start-up.

LLM inference is *semi* information-agnostic: output lengths are unknown, but an iteration's
time is predictable from its shape. The initiation iteration grows about linearly with the input
length; an increment iteration barely grows with the batch. The skip-join MLFQ uses the first
to place a new job and the second for Q1's quantum and for demotion.

`Profiler` is the set of synthetic probe iterations the scheduler times through its own loop
before any request; `IterationProfile` interpolates the measured points piecewise-linearly and
travels as a plain dict (a message, a JSON cache file).
"""
from __future__ import annotations

import json
import statistics
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_mq.protocol.iteration import IterationPlan, SeqWork

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.models.info import ModelInfo

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
        per iteration at 10 GB/s, 2 FLOPs per weight per token at 100 GFLOP/s)."""
        h, d = info.hidden_size, info.head_dim
        params = info.n_layers * (2 * h * info.n_heads * d + 2 * h * info.n_kv_heads * d + 3 * h * info.intermediate_size)
        params += info.vocab_size * h
        read = params * (4 if dtype == "float32" else 2) / 10e9
        per_token = 2 * params / 100e9
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


class Profiler:
    """The synthetic iterations to time and the profile fitted from their timings:
    initiation of one request of 1, 16, 32, 64, ... up to max_len tokens, and increments of
    1, 2, 4, ... max_bs requests (at most as many as the pool holds, each with INCREMENT_CONTEXT of KV
    or what a smaller pool has), all inside a KV pool of num_blocks blocks. The probes write
    garbage into blocks no request owns yet, so they run before any request, one at a time, through
    the scheduler's own iteration loop (`Scheduler.step`): offline, served (timing the whole
    pipeline, control frame out to tokens back) and simulated alike. Their iteration numbers are
    negative: they never collide with a scheduler's. The first pass is a warm-up."""

    def __init__(self, block_size: int, num_blocks: int, max_len: int, max_bs: int, repeats: int = 3) -> None:
        max_len = min(max_len, num_blocks * block_size)
        context = min(INCREMENT_CONTEXT, max_len - 1)   # a pool smaller than one probe request still gets one
        per_req = -(-(context + 1) // block_size)
        probes: list[tuple[str, int, list[SeqWork]]] = [
            ("initiation", n, [SeqWork("probe", [PROBE_TOKEN] * n, 0, list(range(-(-n // block_size))))])
            for n in sorted({1, max_len, *(n for n in (16 << i for i in range(16)) if n < max_len)})
        ]
        most = min(max_bs, num_blocks // per_req)
        for b in sorted({most, *(b for b in (1 << i for i in range(16)) if b < most)} - {0}):
            seqs = [SeqWork(f"probe{i}", [PROBE_TOKEN], context, list(range(i * per_req, (i + 1) * per_req)))
                    for i in range(b)]
            probes.append(("increment", b, seqs))
        self.plans: list[IterationPlan] = []
        self._what: dict[int, tuple[str, int]] = {}
        for rep in range(repeats + 1):
            for kind, x, seqs in probes:
                self.plans.append(IterationPlan(-1 - len(self.plans), seqs))
                if rep:
                    self._what[self.plans[-1].iteration] = (kind, x)
        self._samples: dict[str, dict[int, list[float]]] = {"initiation": {}, "increment": {}}
        self._next = 0
        self._sent: tuple[int, float] | None = None   # the probe in flight: (iteration, when it was planned)

    def next_plan(self, now: float) -> IterationPlan | None:
        """The next probe, when none is in flight (each is timed alone)."""
        if self._sent is not None or self._next == len(self.plans):
            return None
        plan = self.plans[self._next]
        self._next += 1
        self._sent = (plan.iteration, now)
        return plan

    def owns(self, iteration: int) -> bool:
        return self._sent is not None and self._sent[0] == iteration

    def finish(self, now: float) -> IterationProfile | None:
        """The probe in flight returned at `now`; the fitted profile once the last one has."""
        assert self._sent is not None
        iteration, sent = self._sent
        self._sent = None
        if iteration in self._what:
            kind, x = self._what[iteration]
            self._samples[kind].setdefault(x, []).append(now - sent)
        return self.profile() if self._next == len(self.plans) else None

    def profile(self) -> IterationProfile:
        return IterationProfile.fit(self._samples["initiation"], self._samples["increment"])


def profile_max_len(cfg: "Config", info: "ModelInfo") -> int:
    """Longest initiation probe: longer inputs are extrapolated along the last measured segment."""
    return min(info.max_model_len(cfg), cfg.fastserve.profile_max_len)
