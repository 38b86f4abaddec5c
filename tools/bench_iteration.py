#!/usr/bin/env python3
"""An iteration's time, accounted: decode at b=1, 8, 32 and a mixed 256-token chunked iteration
(a 225-token prompt beside 31 decodes).

    python tools/bench_iteration.py --out results/bench_iteration.json
    python tools/bench_iteration.py --no-serve --repeat 9 --set engine.gemm=torch --out results/it_torch.json

1. The engine in this process (plan -> sampled tokens, the worker's compute path, greedy rows, KV of
   256 tokens per decode): the iteration's median time, and with timers on the model's seams
   (orca_mq/bench/accounting.py) its GEMMs (layers, LM head), attention, norms, rotary, sampling and
   the plan's tensors; the rest (residual adds, activation, views, Python between ops) by difference.
2. The same batches served by a whole server (1 worker, ZeroMQ client) in steady state
   (orca_mq/bench/steady.py): the worker's compute per iteration, the message round trip (result to
   the scheduler, its turnaround, the next plan to the worker), the worker's idle time between
   iterations, and the CPU time each process of the server (and the client) spends per iteration.
Prints a table and writes JSON. Timing runs go under `flock /tmp/orca-bench.lock`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from orca_mq.bench.accounting import CATEGORIES, instrument
from orca_mq.bench.bench_server import on_sigterm
from orca_mq.bench.plans import plan_for
from orca_mq.bench.steady import Case, run_case
from orca_mq.bench.timing import timed
from orca_mq.config import load_config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.runtime.threads import use_threads
from orca_mq.server.process import free_port, spawn

CASES = [Case("decode b=1", 1), Case("decode b=8", 8), Case("decode b=32", 32),
         Case("mixed 225+31", 31, n_chunk=40, chunk=225)]
OTHERS = ("broker", "frontend", "scheduler", "http", "launcher", "client")


def engine_reqs(case: Case) -> list[tuple[int, int]]:
    return [(case.chunk, 0)] * bool(case.n_chunk) + [(1, 255)] * case.n_decode


def account(runner: ModelRunner, reqs: list[tuple[int, int]], repeat: int) -> dict[str, float]:
    """ms of the plain iteration (median) and of each category (medians of the timed runs), and the rest."""
    plan = plan_for(reqs, runner.block_size)

    def step() -> None:
        runner.execute(plan)

    step()
    plain, parts = [], []
    for _ in range(repeat):   # plain and timed runs alternate: load swings hit both
        plain.append(timed(step))
        with instrument(runner) as ledger:
            timed_total = timed(step)
        parts.append(ledger.reset() | {"timed total": timed_total})
    out = {k: statistics.median(p[k] for p in parts) * 1e3 for k in (*CATEGORIES, "timed total")}
    out["iteration"] = statistics.median(plain) * 1e3
    out["other ops + Python"] = out["iteration"] - sum(out[k] for k in CATEGORIES)
    return out


def serve(sets: list[str], repeat_seed: int) -> list[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="orca_mq_iteration-"))
    cfg = {"server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "server.http_address": f"127.0.0.1:{free_port()}",
           "scheduler.max_bs": 32, "scheduler.max_num_batched_tokens": 256, "log.dir": str(tmp / "logs"),
           "log.level": "warning", **dict(s.split("=", 1) for s in sets)}
    handle = spawn(cfg, tmp / "launcher.stderr", ready_timeout=600)
    try:
        return [asyncio.run(run_case(handle, case, repeat_seed + i)) for i, case in enumerate(CASES)]
    finally:
        handle.stop(60)


def table(engine: dict[str, dict[str, float]], served: list[dict[str, Any]]) -> str:
    names = [c.name for c in CASES]
    lines = [f"{'ms per iteration':34}" + "".join(f"{n:>16}" for n in names)]

    def row(label: str, values: list[float | None]) -> None:
        lines.append(f"{label:34}" + "".join(f"{v:>16.2f}" if v is not None else f"{'-':>16}" for v in values))

    for k in ("iteration", *CATEGORIES, "other ops + Python"):
        row(f"engine: {k}", [engine[n][k] for n in names])
    row("engine: timed total (timer cost)", [engine[n]["timed total"] for n in names])
    if served:
        s = {r["case"]: r for r in served}
        row("served: worker compute", [s[n]["compute_ms"] for n in names])
        row("served: result trip", [s[n]["result_trip_ms"] for n in names])
        row("served: scheduler turnaround", [s[n]["turnaround_ms"] for n in names])
        row("served: plan trip", [s[n]["plan_trip_ms"] for n in names])
        row("served: worker idle", [s[n]["idle_ms"] for n in names])
        for role in ("worker", *OTHERS):
            row(f"served: CPU of {role}", [s[n]["cpu_ms_per_iteration"].get(role) for n in names])
        row("served: others' CPU / 2 cores (%)", [100 * sum(s[n]["cpu_ms_per_iteration"].get(r, 0) for r in OTHERS)
                                                 / (2 * (s[n]["compute_ms"] + s[n]["idle_ms"])) for n in names])
        row("served: iterations in the window", [s[n]["iterations"] for n in names])
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-serve", action="store_true", help="the engine part only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench_iteration.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)   # so `finally` stops the server when this is terminated
    cfg = load_config(None, ["engine.n_slots=32768", *args.set])
    use_threads(cfg.engine.threads_per_worker)
    runner = ModelRunner(cfg)
    print(f"engine: {runner.dtype}, attention {runner.model.attention_backend}, GEMMs {runner.gemm}, "
          f"{torch.get_num_threads()} threads", flush=True)
    engine = {}
    for case in CASES:
        engine[case.name] = account(runner, engine_reqs(case), args.repeat)
        print(f"  {case.name}: {engine[case.name]['iteration']:.1f} ms", flush=True)
    del runner
    served = [] if args.no_serve else serve(args.set, args.seed)
    text = table(engine, served)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": cfg.to_dict(), "engine": engine, "served": served, "table": text}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
