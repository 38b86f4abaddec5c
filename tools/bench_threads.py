#!/usr/bin/env python3
"""Where a worker builds its model: one decode iteration timed on a compute thread, with the model built
on that thread (one OpenMP team: what workers do) or on the main thread (two teams: what they did),
each in a fresh process, interleaved round by round. Prints median ms and the cores used; writes JSON.

    python tools/bench_threads.py --rounds 3 --batch 32 --out results/bench_threads.json

libgomp keeps a team of worker threads per thread that opened a parallel region; once it manages more
threads than there are CPUs it throttles their spin-wait, so each parallel region waits on futex
wake-ups (orca_mq/runtime/threads.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

MODES = ("compute-thread", "main-thread")


def child(mode: str, batch: int, repeat: int, sets: list[str]) -> dict[str, float]:
    """One process: build a runner on `mode`'s thread, then time decode iterations on a compute thread."""
    from orca_mq.bench.plans import plan_for
    from orca_mq.bench.timing import median_time
    from orca_mq.config import load_config
    from orca_mq.engine.model_runner import ModelRunner
    from orca_mq.runtime.threads import use_threads

    cfg = load_config(None, ["engine.n_slots=32768", *sets])
    out: dict[str, float] = {}

    def build() -> ModelRunner:
        return ModelRunner(cfg)

    def compute(runner: ModelRunner) -> None:
        use_threads(cfg.engine.threads_per_worker)
        plan = plan_for([(1, 255)] * batch, runner.block_size)
        runner.forward(plan)
        t0, c0 = time.perf_counter(), sum(os.times()[:2])
        out["ms"] = median_time(lambda: runner.forward(plan), repeat) * 1e3
        out["cores"] = (sum(os.times()[:2]) - c0) / (time.perf_counter() - t0)

    if mode == "main-thread":
        runner = build()
        thread = threading.Thread(target=compute, args=(runner,))
    else:
        thread = threading.Thread(target=lambda: compute(build()))
    thread.start()
    thread.join()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeat", type=int, default=10, help="timed iterations per process")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", default="results/bench_threads.json")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.repeat, args.set)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            cmd = [sys.executable, __file__, "--child", mode, "--batch", str(args.batch), "--repeat", str(args.repeat),
                   *(a for s in args.set for a in ("--set", s))]
            line = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            runs[mode].append(json.loads(line))
            print(f"round {r} {mode}: {runs[mode][-1]['ms']:.1f} ms, {runs[mode][-1]['cores']:.2f} cores", file=sys.stderr)
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in ("ms", "cores")} for m in MODES}
    print(f"decode b={args.batch}, median of {args.rounds} processes x {args.repeat} iterations")
    print(f"{'model built on':<16} {'ms / iteration':>15} {'cores used':>11}")
    for m in MODES:
        print(f"{m:<16} {med[m]['ms']:>15.1f} {med[m]['cores']:>11.2f}")
    ratio = med["main-thread"]["ms"] / med["compute-thread"]["ms"]
    print(f"main-thread / compute-thread: {ratio:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"batch": args.batch, "sets": args.set, "runs": runs, "medians": med, "ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
