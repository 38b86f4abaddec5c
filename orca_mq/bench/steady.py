"""A served iteration in steady state: what the worker, the messages and every other process cost
per iteration while a fixed batch runs (tools/bench_iteration.py).

A case is `n_decode` requests of `prompt_len` tokens generating `max_tokens` each (the batch), plus
optionally `n_chunk` requests of `chunk` prompt tokens and one output token, sent after them: once
the batch decodes, each iteration is its decodes plus one of those prompts (FCFS, `max_bs` =
n_decode + 1, a token budget of n_decode + chunk). The window runs from the moment every batch
request has its first token until the first of them finishes (decode cases) or the last extra
prompt has finished (mixed cases); over it the worker's own timings come from its stats, and the
CPU time of every process of the server (and of this client) from /proc.
"""
from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass
from typing import Any

from orca_mq.bench.timing import cpu_seconds
from orca_mq.client import AsyncClient
from orca_mq.server.process import ServerHandle

ROLES = {"broker": "orca_mq.server.broker", "frontend": "orca_mq.server.frontend",
         "scheduler": "orca_mq.server.scheduler_process", "worker": "workers.main", "http": "orca_mq.api.server"}


@dataclass(slots=True)
class Case:
    name: str
    n_decode: int
    prompt_len: int = 240
    max_tokens: int = 64
    n_chunk: int = 0
    chunk: int = 0


def processes(handle: ServerHandle) -> dict[str, int]:
    """role -> pid of the server's processes, its launcher and this client."""
    kids = handle.children()
    pids = {role: next((pid for pid, cmd in kids.items() if module in cmd), None) for role, module in ROLES.items()}
    found = {role: pid for role, pid in pids.items() if pid is not None}
    return found | {"launcher": handle.proc.pid, "client": os.getpid()}


async def run_case(handle: ServerHandle, case: Case, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]   # fresh tokens: no prefix is shared

    pids = processes(handle)
    started, first_done, window = asyncio.Event(), asyncio.Event(), {}
    with_first, chunks_left = set(), case.n_chunk

    async with AsyncClient(handle.address) as client:
        async def one(i: int, ids: list[int], max_tokens: int) -> None:
            nonlocal chunks_left
            async for ev in client.stream(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                if ev.error:
                    raise RuntimeError(f"request failed: {ev.error}")
                if i < case.n_decode and ev.token_ids and i not in with_first:
                    with_first.add(i)
                    if len(with_first) == case.n_decode:
                        started.set()
                if ev.finished:
                    break
            if i >= case.n_decode:
                chunks_left -= 1
            if (i < case.n_decode and not case.n_chunk) or (case.n_chunk and chunks_left == 0):
                first_done.set()

        async def snapshot() -> tuple[dict[str, float], dict[str, Any]]:
            stats = await client.stats(reset=not window)
            return {role: cpu_seconds(pid) for role, pid in pids.items()}, stats

        tasks = [asyncio.create_task(one(i, prompt(case.prompt_len), case.max_tokens)) for i in range(case.n_decode)]
        await asyncio.sleep(0.05)   # arrival order: the batch first
        tasks += [asyncio.create_task(one(case.n_decode + j, prompt(case.chunk), 1)) for j in range(case.n_chunk)]
        await started.wait()
        window["start"] = await snapshot()
        await first_done.wait()
        window["end"] = await snapshot()
        await asyncio.gather(*tasks)
    (cpu0, stats0), (cpu1, stats) = window["start"], window["end"]
    worker = stats["workers"][0]
    n = max(worker["iterations"] - stats0["workers"][0]["iterations"], 1)
    sched = stats["scheduler"]
    return {
        "case": case.name, "iterations": n,
        "compute_ms": worker["compute"]["median_ms"], "idle_ms": worker["idle"]["median_ms"],
        "plan_trip_ms": worker["plan_latency"]["median_ms"], "result_trip_ms": sched["result_latency"]["median_ms"],
        "turnaround_ms": sched["turnaround"]["median_ms"],
        "cpu_ms_per_iteration": {role: (cpu1[role] - cpu0[role]) * 1e3 / n for role in cpu0},
    }
