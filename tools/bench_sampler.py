#!/usr/bin/env python
"""The last stage's per-iteration work after the LM head on the CPU (issue 44): the sampling step and the
log probabilities over [rows, vocab] logits, the extension's fused kernels (kernels/csrc/sample_cpu.cpp)
against torch's ops (the path a device takes, and the CPU's where the extension cannot be built),
interleaved round by round; medians in ms. Cases: greedy rows, greedy under a grammar's bitmask,
drawn rows (temperature 1), drawn under bitmasks, drawn with logit biases, top-k, top-p (and a
nucleus of most of the vocabulary), the cuts on rows shaped like a model's (`peaked`: one logit far above the
rest, forty between), and log probabilities with the top 20. The default shape is an
n = 16 request beside a bystander on the embedded model's vocabulary.
Prints a table and writes JSON (--out).

    python tools/bench_sampler.py --out results/bench_sampler.json [--rows 17] [--vocab 49152] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from unittest import mock

import numpy as np
import torch

from kernels import cpu_kernels
from orca_mq.engine import logprobs, sampler
from orca_mq.protocol.iteration import Biases, IterationPlan, RowExtras, SeqWork, mask_bytes, pack

Case = Callable[[], object]


def cases(rows: int, vocab: int) -> dict[str, Case]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    peaked = torch.randn(rows, vocab, generator=gen) * 2.5   # a model's row: one logit far above, forty between
    for b in range(rows):
        between = torch.randperm(vocab, generator=gen)[:40]
        peaked[b, between] = 8 + 7 * torch.rand(40, generator=gen)
        peaked[b, between[0]] = 18
    mask = bytes(np.random.default_rng(0).integers(0, 256, mask_bytes(vocab), dtype=np.uint8))
    bias = RowExtras(bias=Biases.of((t, 1.5) for t in range(0, vocab, 97)))

    def step(x: torch.Tensor = logits, **kw: object) -> Case:
        seqs = [SeqWork(f"r{b}", [1], 9, [0], seed=b, **kw) for b in range(rows)]   # type: ignore[arg-type]
        sampling = sampler.SamplingRows.of(pack(IterationPlan(0, seqs)).arrays())
        return lambda: sampler.sample(x, sampling)

    everyone, targets = torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    return {"greedy": step(temperature=0.0), "greedy, masked": step(temperature=0.0, allowed_token_bitmask=mask),
            "drawn": step(temperature=1.0), "drawn, masked": step(temperature=1.0, allowed_token_bitmask=mask),
            "drawn, logit_bias": step(temperature=1.0, extra=bias),
            "top_k 50": step(temperature=1.0, top_k=50), "top_p 0.9": step(temperature=1.0, top_p=0.9),
            "top_p 0.99, T 2": step(temperature=2.0, top_p=0.99),   # a nucleus of most of the vocabulary
            "top_k 50, peaked": step(peaked, temperature=1.0, top_k=50),
            "top_p 0.9, peaked": step(peaked, temperature=1.0, top_p=0.9),
            "top_k 40 top_p .95, peaked": step(peaked, temperature=1.0, top_k=40, top_p=0.95),
            "logprobs top 20": lambda: logprobs._compute(logits, everyone, targets, 20)}


def median_ms(fn: Case, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=17, help="logit rows (an n = 16 request and a bystander)")
    p.add_argument("--vocab", type=int, default=49_152, help="the embedded model's")
    p.add_argument("--rounds", type=int, default=5, help="fused / ops pairs, interleaved")
    p.add_argument("--reps", type=int, default=50, help="calls per case per round")
    p.add_argument("--out", required=True, metavar="FILE.json")
    args = p.parse_args()
    if cpu_kernels.load() is None:
        raise SystemExit("the CPU kernels cannot be built here: nothing to compare")
    every = cases(args.rows, args.vocab)
    times: dict[str, dict[str, list[float]]] = {name: {"fused": [], "ops": []} for name in every}
    for _ in range(args.rounds):
        for name, fn in every.items():
            times[name]["fused"].append(median_ms(fn, args.reps))
            with mock.patch.object(cpu_kernels, "load", lambda: None):
                times[name]["ops"].append(median_ms(fn, args.reps))
    print(f"{args.rows} x {args.vocab} float32 logits, {torch.get_num_threads()} threads, medians of {args.rounds} rounds (ms)")
    print(f"{'case':26} {'fused':>8} {'ops':>8} {'ops / fused':>12}")
    report = {"rows": args.rows, "vocab": args.vocab, "threads": torch.get_num_threads(), "cases": {}}
    for name, t in times.items():
        fused, ops = statistics.median(t["fused"]), statistics.median(t["ops"])
        report["cases"][name] = {"fused_ms": fused, "ops_ms": ops, "rounds": t}
        print(f"{name:26} {fused:8.3f} {ops:8.3f} {ops / fused:11.1f}x")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
