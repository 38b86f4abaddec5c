"""Intra-op threads belong to a thread, not a process, in torch's OpenMP build: each thread that
computes sets its own (`use_threads`), and a process computes on one thread.

Why one: libgomp keeps a team of worker threads per thread that opened a parallel region, and once
it manages more threads than there are CPUs it throttles their spin-wait, so every parallel region
then waits on futex wake-ups. A worker that built its model on the main thread and ran it on a
compute thread had two teams on two cores: a decode iteration took 1.13x as long on 1.5 of its 2
cores (tools/bench_threads.py), and a 64-request burst 1.3-1.5x as long (BENCHMARKS.md, issue 16).

Why the compute thread sets its count last in a process: torch keeps the count any thread set last
as a process-wide value, and every lazy per-thread init adopts it. Each shared library built against
ATen has its own copy of that init (an inline function's thread_local): the CPU decode kernel's first
`at::parallel_for` on the compute thread reset it to the 1 that a FastServe worker's copy thread had
set, and every FastServe iteration then ran on one core (issue 21). The kernel now opens its own
OpenMP region, and workers set the compute thread's count after their copy thread has set its own.
"""
from __future__ import annotations

import torch


def use_threads(n: int) -> None:
    """Give the calling thread `n` intra-op threads. `torch.get_num_threads()` first runs torch's lazy
    per-thread init, which would otherwise later reset this thread to whatever `set_num_threads` any
    thread called last."""
    torch.get_num_threads()
    torch.set_num_threads(n)
