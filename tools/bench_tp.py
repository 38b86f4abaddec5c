"""Tensor- and pipeline-parallel benchmark on this machine: what TP's all-reduces cost, and the time
per iteration for TP 1 / 2 x PP 1 / 2, on the embedded SmolLM2-135M (or --model).

For each grid (real worker processes over gloo, workers/local_grid.py) every case runs back to back
and the last stage's TP rank 0 reports the median interval between completed iterations (with PP,
stages overlap consecutive iterations as in serving). With TP it also reports the time spent inside
the all-reduces (two per layer plus the embedding's; waits for the slower rank included), and a
micro-benchmark of the all-reduces alone: 2 x n_layers all-reduces of [tokens, hidden] fp32.
The machine's cores are shared by all ranks: threads_per_worker = max(1, cores // ranks).

    python tools/bench_tp.py --out results/bench_tp.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orca_mq.bench.plans import block_tables
from orca_mq.config import load_config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.protocol.iteration import IterationPlan, SeqWork
from workers.local_grid import Step, run_grid

# (name, [(new tokens, cached tokens before)] per request)
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("decode b=16 kv=256", [(1, 255)] * 16),
    ("prefill 256", [(256, 0)]),
    ("mixed 1x128 prefill + 15 decodes", [(128, 0)] + [(1, 255)] * 15),
]
MICRO_TOKENS = (1, 16, 256)
GRIDS = [(1, 1), (1, 2), (2, 1), (2, 2)]   # (pipeline stages, tp_size)


def _plan(case: list[tuple[int, int]], block_size: int, iteration: int) -> IterationPlan:
    tables = block_tables((new + cached for new, cached in case), block_size)
    return IterationPlan(iteration, [SeqWork(str(i), [7] * new, cached, table)
                                     for i, ((new, cached), table) in enumerate(zip(case, tables))])


def _bench_job(step: Step, runner: ModelRunner, repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {"micro_allreduce_ms": {}, "cases": {}}
    tp = runner.tp
    if tp.size > 1:  # the all-reduces alone, as many as one iteration of this stage issues
        n = 2 * len(runner.model.layers)
        for t in MICRO_TOKENS:
            x = torch.randn(t, runner.hidden_size)
            times = []
            for _ in range(repeat):
                dist.barrier(group=tp.where.group)
                t0 = time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(x, group=tp.where.group)
                times.append(time.perf_counter() - t0)
            out["micro_allreduce_ms"][t] = 1e3 * statistics.median(times)
    spent = [0.0]
    reduce = tp.reduce

    def timed_reduce(x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        r = reduce(x)
        spent[0] += time.perf_counter() - t0
        return r

    tp.reduce = timed_reduce  # type: ignore[method-assign]
    it = 0
    for name, case in CASES:
        ends, in_reduce = [], []
        for _ in range(repeat + 2):
            spent[0] = 0.0
            step(_plan(case, runner.block_size, it))
            it += 1
            ends.append(time.perf_counter())
            in_reduce.append(spent[0])
        intervals = [b - a for a, b in zip(ends[2:], ends[3:])]
        out["cases"][name] = {"iteration_ms": 1e3 * statistics.median(intervals),
                              "allreduce_ms": 1e3 * statistics.median(in_reduce[2:])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--grids", default=",".join(f"{pp}x{tp}" for pp, tp in GRIDS), help="PPxTP,... e.g. 1x1,1x2")
    ap.add_argument("--threads", type=int, default=0, help="threads per worker (default: cores // ranks)")
    ap.add_argument("--out", default="results/bench_tp.json")
    args = ap.parse_args()
    results = []
    for pp, tp in (tuple(int(x) for x in g.split("x")) for g in args.grids.split(",")):
        cfg = load_config(overrides={"model.path": args.model, "engine.n_slots": 16384,
                                     "engine.threads_per_worker": args.threads or max(1, args.cores // (pp * tp))})
        t0 = time.perf_counter()
        r = run_grid(pp, tp, cfg, _bench_job, args.repeat, timeout=1800.0)
        results.append({"pp": pp, "tp": tp, "threads_per_worker": cfg.engine.threads_per_worker,
                        "loadavg_1min_after": os.getloadavg()[0], **r})  # a shared machine's load skews every figure
        print(f"PP {pp} x TP {tp} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"{'grid':<18}" + "".join(f"{name:>36}" for name, _ in CASES))
    for r in results:
        cells = [f"{c['iteration_ms']:8.1f} ms (all-reduce {c['allreduce_ms']:6.1f})" for c in r["cases"].values()]
        print(f"PP{r['pp']} x TP{r['tp']} x {r['threads_per_worker']}thr  " + "".join(f"{c:>36}" for c in cells) + f"   load {r['loadavg_1min_after']:.1f}")
    for r in results:
        if r["micro_allreduce_ms"]:
            micro = ", ".join(f"{t} tok {ms:.2f} ms" for t, ms in r["micro_allreduce_ms"].items())
            print(f"PP{r['pp']} x TP{r['tp']}: all-reduces of one iteration alone (gloo): {micro}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cores": args.cores, "results": results}, indent=2))


if __name__ == "__main__":
    main()
