#!/usr/bin/env python3
"""The host side of an iteration, part by part: what a GPU waits for when the host is slower than it.

The offline engine's own loop on a narrow random Llama (30 layers of hidden 64, the embedded model's
vocabulary: the model's compute is not what is asked about), a burst of `--batch` requests decoding
together, every iteration's plan also sent through the control frame's codec. Per iteration, mean
over the burst: the scheduler's step, the plan packed into columns, encoded, decoded, and the
engine's inputs built from the columns (orca_mq/engine/step_inputs.py). Prints a table, writes JSON.

    python tools/bench_host.py --batch 512 --out results/bench_host.json
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from orca_mq import LLM, SamplingParams
from orca_mq.bench.random_models import random_llama
from orca_mq.engine.step_inputs import build
from orca_mq.protocol import decode, encode
from orca_mq.protocol.codec import channel
from orca_mq.protocol.engine_msgs import ControlFrame
from orca_mq.protocol.iteration import IterationResult, pack

PARTS = ("step", "pack", "encode", "decode", "inputs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512, help="requests decoding together (scheduler.max_bs)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each generates")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = random_llama(Path(tempfile.mkdtemp(prefix="bench_host-")) / "narrow", layers=30, max_positions=2048)
    llm = LLM(model=str(model), dtype="float32", max_bs=args.batch, n_slots=args.batch * 384,
              max_num_batched_tokens=4096, async_scheduling="off", cuda_graphs="off")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))] for _ in range(args.batch)]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], sp)
    seconds = dict.fromkeys(PARTS, 0.0)
    frames = channel(ControlFrame)
    sched, runner = llm.scheduler, llm.runner
    for i, p in enumerate(prompts):
        sched.add(llm.model.request(f"r{i}", p, llm.model.fit(p, sp)))
    results: list[IterationResult] = []
    n = 0
    while True:
        t = [time.perf_counter()]
        out = sched.step(time.monotonic(), results)
        t.append(time.perf_counter())
        if not out.plans:
            break
        plan = out.plans[0]
        packed = pack(plan)
        t.append(time.perf_counter())
        frame = encode(ControlFrame(packed, 0.0))
        t.append(time.perf_counter())
        wire = decode(frame, frames).plan
        t.append(time.perf_counter())
        build(wire.arrays(), runner.geometry)
        t.append(time.perf_counter())
        for part, a, b in zip(PARTS, t, t[1:]):
            seconds[part] += b - a
        results = [runner.execute(wire)]   # type: ignore[list-item]
        n += 1
    per = {k: v / n * 1e3 for k, v in seconds.items()}
    print(f"host side of an iteration, {args.batch} requests, mean of {n} iterations (ms)")
    for k in PARTS:
        print(f"  {k:8s} {per[k]:7.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"batch": args.batch, "iterations": n, "ms_per_iteration": per}, indent=1))


if __name__ == "__main__":
    main()
