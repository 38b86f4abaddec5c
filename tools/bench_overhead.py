#!/usr/bin/env python
"""Serving overhead benchmark: starts real servers with tools/launch.py and measures

1. scheduler + messaging overhead per iteration: the time each pipeline stage is idle between
   two of its iterations (median), with batches of `--batch` requests keeping every stage busy
   (n_workers x batch requests, scheduler.max_bs = batch), for 1 and 2 workers; and its parts:
   the result's trip from the last worker to the scheduler, the scheduler's turnaround (result
   received -> next plan sent), the plan's trip from the scheduler to stage 0's compute start;
2. throughput of 2 workers x 1 thread vs 1 worker x 2 threads on the same trace (all requests
   at once, input ~ U(32, 128) tokens, output ~ U(16, 64) tokens, generation forced).

Prints a table and writes JSON (`--out`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from orca_mq.bench.bench_server import Server
from orca_mq.client import AsyncClient


def _trace(n: int, seed: int, in_range: tuple[int, int], out_range: tuple[int, int]) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 10_000) for _ in range(rng.randint(*in_range))], rng.randint(*out_range)) for _ in range(n)]


async def _run(address: str, trace: list[tuple[list[int], int]], reset_first: bool) -> tuple[float, int, dict[str, Any]]:
    async with AsyncClient(address) as client:
        await client.generate(prompt_token_ids=[1, 2, 3], max_tokens=2, temperature=0.0)  # warm-up
        if reset_first:
            await client.stats(reset=True)
        start = time.perf_counter()
        outs = await asyncio.gather(*(client.generate(prompt_token_ids=ids, max_tokens=m, temperature=0.0, ignore_eos=True)
                                      for ids, m in trace))
        wall = time.perf_counter() - start
        bad = [o.error for o in outs if o.finish_reason != "length"]
        if bad:
            raise RuntimeError(f"requests failed: {bad[:3]}")
        return wall, sum(len(o.token_ids) for o in outs), await client.stats()


def overhead(workers: int, batch: int, tokens: int, extra: list[str]) -> dict[str, Any]:
    threads = max(1, 2 // workers)
    trace = _trace(workers * batch, 0, (32, 32), (tokens, tokens))
    with Server(workers, threads, batch, extra) as srv:
        wall, n_tokens, stats = asyncio.run(_run(srv.address, trace, reset_first=True))
    sched = stats["scheduler"]
    return {
        "workers": workers, "threads_per_worker": threads, "batch": batch, "requests": len(trace), "wall_s": wall,
        "stage_idle_median_ms": [w["idle"]["median_ms"] for w in stats["workers"]],
        "stage_compute_median_ms": [w["compute"]["median_ms"] for w in stats["workers"]],
        "plan_latency_median_ms": stats["workers"][0]["plan_latency"]["median_ms"],
        "scheduler_turnaround_median_ms": sched["turnaround"]["median_ms"],
        "result_latency_median_ms": sched["result_latency"]["median_ms"],
        "iterations": stats["workers"][0]["iterations"],
    }


def throughput(workers: int, threads: int, trace: list[tuple[list[int], int]], max_bs: int, extra: list[str]) -> dict[str, Any]:
    with Server(workers, threads, max_bs, extra) as srv:
        wall, n_tokens, _ = asyncio.run(_run(srv.address, trace, reset_first=False))
    return {"workers": workers, "threads_per_worker": threads, "requests": len(trace), "max_bs": max_bs,
            "wall_s": wall, "output_tokens": n_tokens, "tokens_per_s": n_tokens / wall, "requests_per_s": len(trace) / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8, help="requests per iteration for the overhead runs")
    p.add_argument("--tokens", type=int, default=48, help="output tokens per request in the overhead runs")
    p.add_argument("--requests", type=int, default=32, help="requests in the throughput trace")
    p.add_argument("--max-bs", type=int, default=16, help="scheduler.max_bs of the throughput runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="extra config override for every server")
    p.add_argument("--out", default="bench_overhead.json")
    args = p.parse_args(argv)

    result: dict[str, Any] = {"overhead": [], "throughput": []}
    print(f"{'workers':>7} {'req':>4} {'idle/stage median ms':>22} {'compute/stage ms':>18} {'sched ms':>9} "
          f"{'result ms':>9} {'plan ms':>8}")
    for workers in (1, 2):
        r = overhead(workers, args.batch, args.tokens, args.set)
        result["overhead"].append(r)
        fmt = lambda xs: "/".join(f"{x:.2f}" if x is not None else "-" for x in xs)  # noqa: E731
        print(f"{workers:>7} {r['requests']:>4} {fmt(r['stage_idle_median_ms']):>22} {fmt(r['stage_compute_median_ms']):>18} "
              f"{r['scheduler_turnaround_median_ms']:>9.3f} {r['result_latency_median_ms']:>9.3f} "
              f"{r['plan_latency_median_ms']:>8.3f}", flush=True)

    trace = _trace(args.requests, args.seed, (32, 128), (16, 64))
    print(f"\n{'config':>18} {'wall s':>8} {'tokens/s':>9} {'req/s':>7}")
    for workers, threads in ((2, 1), (1, 2)):
        r = throughput(workers, threads, trace, args.max_bs, args.set)
        result["throughput"].append(r)
        print(f"{f'{workers} worker x {threads} thr':>18} {r['wall_s']:>8.2f} {r['tokens_per_s']:>9.1f} {r['requests_per_s']:>7.2f}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
