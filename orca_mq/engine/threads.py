"""Intra-op threads belong to a thread, not a process, in torch's OpenMP build: each thread that
computes sets its own (`use_threads`), and a process computes on one thread.

Why one: libgomp keeps a team of worker threads per thread that opened a parallel region, and once
it manages more threads than there are CPUs it throttles their spin-wait, so every parallel region
then waits on futex wake-ups. A worker that built its model on the main thread and ran it on a
compute thread had two teams on two cores: a decode iteration took 1.13x as long on 1.5 of its 2
cores (tools/bench_threads.py), and a 64-request burst 1.3-1.5x as long (BENCHMARKS.md, issue 16).
"""
from __future__ import annotations

import torch


def use_threads(n: int) -> None:
    """Give the calling thread `n` intra-op threads. `torch.get_num_threads()` first runs torch's lazy
    per-thread init, which would otherwise later reset this thread to whatever `set_num_threads` any
    thread called last."""
    torch.get_num_threads()
    torch.set_num_threads(n)
