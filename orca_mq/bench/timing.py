"""Timing on a shared, noisy machine: medians, and contenders alternated round by round."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def median_time(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of `repeat` calls after one warm-up call."""
    fn()
    return statistics.median(timed(fn) for _ in range(repeat))


def interleaved_medians(fns: Sequence[Callable[[], object]], repeat: int) -> list[float]:
    """Median seconds of each contender, alternated round by round after one warm-up call each,
    so that a shared machine's load swings hit them all alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for t, fn in zip(times, fns):
            t.append(timed(fn))
    return [statistics.median(t) for t in times]


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
