#!/usr/bin/env python
"""What one request's rows cost every other row's iteration (issue 44): a bystander's decode row alone, then
beside 16 decode rows of one kind (an n = 16 request), each iteration's rows built here, packed into columns
(the scheduler's last part; no scheduler runs) and run by the engine in this process (the worker's: forward,
LM head, sampling, log probabilities, logits processors). The model is a random Llama (2 layers by default)
with the embedded model's 49,152-token vocabulary: its layers cost little, so what a row asks of the sampler
shows. Kinds interleaved round by round; medians in ms. Prints a table and writes JSON.

    python tools/bench_row_costs.py --out results/bench_row_costs.json [--rows 16] [--context 300] [--layers 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from orca_mq.bench.random_models import random_llama
from orca_mq.config import load_config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.kv.block_manager import BlockManager
from orca_mq.protocol.iteration import HISTORY_KEEP, HISTORY_START, Biases, IterationPlan, RowExtras, SeqWork

BIASES = Biases.of((t, 1.0) for t in range(1024))   # model.max_logit_bias entries


def kinds() -> dict[str, Callable[[int], dict]]:
    """Each kind's SeqWork fields for a row; `state`: the history's (HISTORY_START on a row's first iteration)."""
    def every(state: int) -> RowExtras:
        return RowExtras(presence=2.0, frequency=2.0, repetition=1.3, min_p=0.05, bias=BIASES, history=state)

    return {
        "greedy": lambda s: {},
        "drawn (T 1)": lambda s: {"temperature": 1.0},
        "top_k 50": lambda s: {"temperature": 1.0, "top_k": 50},
        "top_p 0.9": lambda s: {"temperature": 1.0, "top_p": 0.9},
        "top_p 0.99, T 2": lambda s: {"temperature": 2.0, "top_p": 0.99},
        "logprobs 20": lambda s: {"temperature": 1.0, "logprobs": 20},
        "1,024 biases": lambda s: {"temperature": 1.0, "extra": RowExtras(bias=BIASES)},
        "penalties": lambda s: {"temperature": 1.0,
                                "extra": RowExtras(presence=2.0, frequency=2.0, repetition=1.3, history=s)},
        "every processor": lambda s: {"temperature": 1.0, "extra": every(s)},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16, help="the request's rows (n)")
    p.add_argument("--context", type=int, default=300, help="every row's tokens in the KV cache")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=30, help="iterations per kind per round")
    p.add_argument("--out", required=True, metavar="FILE.json")
    args = p.parse_args()
    path = random_llama(Path(tempfile.mkdtemp(prefix="row-costs-")) / "model", layers=args.layers, max_positions=2048)
    runner = ModelRunner(load_config(overrides={"model.path": str(path)}))
    blocks = BlockManager(runner.pool)
    ctx, ids = args.context, [str(i) for i in range(args.rows + 1)]
    tables = {rid: list(blocks.ensure(rid, ctx + 1)) for rid in ids}
    for rid in ids:   # every row's context in the cache
        runner.execute(IterationPlan(0, [SeqWork(rid, list(range(5, 5 + ctx)), 0, tables[rid])]))
    step = [1]

    def iteration(fields: Callable[[int], dict] | None, state: int) -> float:
        rows = [SeqWork(ids[0], [7], ctx, tables[ids[0]])]
        if fields is not None:
            rows += [SeqWork(rid, [7], ctx, tables[rid], **fields(state)) for rid in ids[1:]]
        t = time.perf_counter()
        runner.execute(IterationPlan(step[0], rows))   # packed into columns, run, sampled
        step[0] += 1
        return time.perf_counter() - t

    cases: dict[str, Callable[[int], dict] | None] = {"bystander alone": None, **kinds()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fields in cases.items():
            iteration(fields, HISTORY_START)   # a penalized row's history starts (and is reset) here
            times[name].append(statistics.median(iteration(fields, HISTORY_KEEP) for _ in range(args.reps)) * 1e3)
    alone = statistics.median(times["bystander alone"])
    print(f"a bystander's decode row beside {args.rows} rows of a kind, context {ctx}, {args.layers} layers, vocabulary "
          f"{runner.info.vocab_size}, {torch.get_num_threads()} threads; medians of {args.rounds} rounds (ms)")
    print(f"{'rows':20} {'iteration':>10} {'x alone':>8}")
    report = {"rows": args.rows, "context": ctx, "layers": args.layers, "vocab": runner.info.vocab_size,
              "threads": torch.get_num_threads(), "cases": {}}
    for name, t in times.items():
        ms = statistics.median(t)
        report["cases"][name] = {"ms": ms, "x_alone": ms / alone, "rounds": t}
        print(f"{name:20} {ms:10.3f} {ms / alone:7.1f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
