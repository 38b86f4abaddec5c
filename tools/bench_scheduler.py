#!/usr/bin/env python
"""The scheduler's CPU per generated token, alone (issue 42, item 5): a policy's `step` and `pack` over a
batch of decoding requests, a fake engine returning one token per row, no processes or sockets: what the
scheduler process pays per iteration before anything is sent. Every request decodes (`ignore_eos`,
greedy) so the batch stays full; iterations are timed after a warm-up, in rounds, and the table gives
each batch size's median. tools/bench_control_plane.py measures the same served, beside the broker's,
frontend's and worker's shares.

With --burst N, instead: the scheduler process's whole work for a served burst of N requests, in this
process and by part (apply, step, the plan's frame, the result's decoding, the token frame; library:
orca_mq/bench/sched_burst.py), with the caches cold (--evict-mb of memory streamed between iterations) and
warm: bench_control_plane's burst, less the sockets and the event loop.

    python tools/bench_scheduler.py [--batch 256,512] [--policy orca] [--iterations 50] [--rounds 3] --out FILE.json
    python tools/bench_scheduler.py --burst 256 [--batch 256] [--input-len 32:512] [--output-len 128] [--budget 2048]
        [--evict-mb 0,128] [--rounds 3] --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from orca_mq.bench.sched_burst import PARTS, burst
from orca_mq.bench.trace import parse_range
from orca_mq.config import load_config
from orca_mq.models.info import ModelInfo
from orca_mq.protocol.iteration import IterationResult, pack
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched import make_scheduler
from orca_mq.sched.request import Request

# a narrow Llama's metadata: only the vocabulary, the context and the EOS reach the scheduler
INFO = ModelInfo(path="bench", arch="llama", vocab_size=49152, hidden_size=64, n_layers=2, n_heads=2, n_kv_heads=1,
                 intermediate_size=16, norm_eps=1e-5, context_length=4096, eos_token_ids=[2])
WARMUP = 5


def per_token_us(batch: int, policy: str, iterations: int, prompt_len: int = 64) -> float:
    """Microseconds of step + pack per generated token, `iterations` all-decode iterations at `batch` rows
    whose prompts are `prompt_len` tokens (a block table of prompt_len / 16 blocks and growing)."""
    cfg = load_config(overrides={"scheduler.policy": policy, "scheduler.max_bs": batch,
                                 "scheduler.max_num_batched_tokens": 4096, "engine.n_slots": batch * (prompt_len + 1024),
                                 "engine.block_size": 16})
    sched = make_scheduler(cfg, INFO)
    warm = WARMUP + batch * prompt_len // 1024   # every prompt prefilled (the budget's chunks), then decoding only
    for i in range(batch):
        sched.add(Request(f"r{i}", [7] * prompt_len, SamplingParams(max_tokens=warm + iterations + 64, ignore_eos=True,
                                                                    temperature=0), arrival=0.0))
    now, results = 0.0, []

    def run(n: int) -> int:
        nonlocal now, results
        made = 0
        for _ in range(n):
            out = sched.step(now, results)
            results = []
            for plan in out.plans:
                n = len(pack(plan).request_ids)   # what the scheduler process sends: no row objects
                results.append(IterationResult(plan.iteration, [5] * n))
                made += n
            now += 0.01
        return made

    run(warm)
    t = time.perf_counter()
    tokens = run(iterations)
    return (time.perf_counter() - t) / max(tokens, 1) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="256,512", help="batch sizes (scheduler.max_bs), comma-separated")
    p.add_argument("--policy", default="orca", choices=["orca", "request", "srpt", "fastserve"])
    p.add_argument("--iterations", type=int, default=50, help="timed iterations per round")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens of each request's prompt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--burst", type=int, default=0, metavar="N", help="instead: a served burst of N requests, by part")
    p.add_argument("--input-len", type=parse_range, default=(32, 512), metavar="MIN:MAX", help="--burst: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="--burst: tokens each request generates")
    p.add_argument("--budget", type=int, default=2048, help="--burst: scheduler.max_num_batched_tokens")
    p.add_argument("--evict-mb", default="0,128", help="--burst: MiB streamed between iterations, comma-separated (0: warm)")
    p.add_argument("--out", required=True, metavar="FILE.json")
    args = p.parse_args(argv)
    if args.burst:
        return burst_table(args)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        runs = [per_token_us(batch, args.policy, args.iterations, args.prompt_len) for _ in range(args.rounds)]
        rows.append({"batch": batch, "policy": args.policy, "us_per_token": runs, "median": statistics.median(runs)})
    print(f"{'batch':>6} {'policy':>9} {'us/token (median)':>18}  runs")
    for r in rows:
        print(f"{r['batch']:>6} {r['policy']:>9} {r['median']:>18.2f}  {', '.join(f'{x:.2f}' for x in r['us_per_token'])}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "iterations": args.iterations, "prompt_len": args.prompt_len}, indent=1))
    print(f"wrote {args.out}")
    return 0


def burst_table(args: argparse.Namespace) -> int:
    if args.policy not in ("orca", "request"):
        raise SystemExit("--burst: orca or request (the others time their profile first)")
    max_bs, rows = int(args.batch.split(",")[0]), []
    for mb in (int(x) for x in args.evict_mb.split(",")):
        runs = [burst(INFO, args.burst, max_bs, args.budget, args.input_len, args.output_len, mb, seed, args.policy)
                for seed in range(args.rounds)]
        parts = {k: statistics.median(r["us_per_token"][k] for r in runs) for k in PARTS}
        rows.append({"evict_mb": mb, "runs": runs, "median_us_per_token": parts,
                     "median_total": statistics.median(sum(r["us_per_token"].values()) for r in runs)})
    print(f"burst of {args.burst} at max_bs {max_bs}, {args.policy}: CPU us per generated token (median of {args.rounds})")
    print(f"{'evict MiB':>10} " + " ".join(f"{k:>13}" for k in PARTS) + f" {'total':>8}")
    for r in rows:
        print(f"{r['evict_mb']:>10} " + " ".join(f"{r['median_us_per_token'][k]:>13.2f}" for k in PARTS) + f" {r['median_total']:>8.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"burst": args.burst, "max_bs": max_bs, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
