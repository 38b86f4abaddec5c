"""Timing on a shared, noisy machine: medians, and contenders alternated round by round."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class CpuTime:
    """A process's CPU time at one moment, to subtract another from: its clock ticks (10 ms: over a
    burst of 33k tokens, 0.3 µs a token) and each live thread's nanoseconds."""
    ticks: float             # cpu_seconds: counts the threads that ended too
    threads: dict[str, int]  # thread id -> ns run (/proc/<pid>/task/<tid>/schedstat); {} where not kept

    def __sub__(self, before: CpuTime) -> float:
        """Seconds between the two: to the nanosecond when every thread of `before` still runs (a thread
        that ended took its nanoseconds with it), else in ticks."""
        if self.threads and before.threads.keys() <= self.threads.keys():
            return sum(ns - before.threads.get(t, 0) for t, ns in self.threads.items()) / 1e9
        return self.ticks - before.ticks


def cpu_time(pid: int | str) -> CpuTime:
    """The process's CPU time now, per live thread where /proc keeps it."""
    threads: dict[str, int] = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            threads[tid] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):   # a thread that ended meanwhile, or no schedstat: ticks
        threads = {}
    return CpuTime(cpu_seconds(pid), threads)
