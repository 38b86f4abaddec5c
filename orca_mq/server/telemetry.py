"""Cumulative engine telemetry the scheduler keeps for the API server's /metrics.

Histograms are cumulative since the scheduler started (Prometheus' model: the scraper takes
rates); they start again from zero when the launcher restarts the scheduler. Everything here is O(buckets), whatever the traffic.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from orca_mq.protocol.iteration import IterationPlan
from orca_mq.sched.request import Request

ITERATION_TIME_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUEUE_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)   # per bucket (not cumulative); the last is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1   # first bucket with value <= bound
        self.total += value

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}


@dataclass(slots=True)
class Telemetry:
    started_at: float = field(default_factory=time.time)
    iteration_time: Histogram = field(default_factory=lambda: Histogram(ITERATION_TIME_BUCKETS))  # plan sent -> tokens back
    batch_size: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKENS_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(QUEUE_TIME_BUCKETS))  # arrival -> first scheduled
    offload_bytes: int = 0        # FastServe KV swaps of finished requests
    upload_bytes: int = 0
    sent: dict[int, float] = field(default_factory=dict)  # iterations in flight (<= n_workers) -> send time

    def plan_sent(self, plan: IterationPlan, pool: Mapping[str, Request], now: float) -> None:
        self.sent[plan.iteration] = now
        self.batch_size.observe(plan.num_rows)
        self.iteration_tokens.observe(plan.num_tokens)
        for seq in plan.seqs if plan.rows is not None else ():   # a plan made in columns is all decode rows
            if seq.start_pos == 0 and (req := pool.get(seq.request_id)) is not None:
                self.queue_time.observe(now - req.arrival)

    def iteration_done(self, iteration: int, now: float) -> None:
        sent = self.sent.pop(iteration, None)
        if sent is not None:
            self.iteration_time.observe(now - sent)

    def finished(self, metrics: Iterable[Mapping[str, Any]]) -> None:
        for m in metrics:
            self.offload_bytes += int(m.get("offload_bytes", 0))
            self.upload_bytes += int(m.get("upload_bytes", 0))

    def to_dict(self, pool: Mapping[str, Request]) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
            "preempted": sum(1 for r in pool.values() if not r.running and r.output_token_ids),
            "offload_bytes": self.offload_bytes, "upload_bytes": self.upload_bytes,
            "iteration_time": self.iteration_time.to_dict(), "batch_size": self.batch_size.to_dict(),
            "iteration_tokens": self.iteration_tokens.to_dict(), "queue_time": self.queue_time.to_dict(),
        }
