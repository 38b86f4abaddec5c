#!/usr/bin/env python3
"""This CPU's compute floor for the served model, and how close the engine and a served trace come to it.

    python tools/bench_floor.py --out results/bench_floor.json                 # the 48-request burst, served once
    python tools/bench_floor.py --rounds 2 --set scheduler.max_bs=32 --out results/floor.json
    python tools/bench_floor.py --no-serve --out results/floor_engine.json     # rates and engine only

In one run, on the worker's thread count and in the dtype `model.dtype` resolves to here:
1. GEMM rates at the model's own shapes: every layer's four products over the stage's real weights
   and the LM head, at M = 1, 8, max_bs, the token budget and 512 rows, by every GEMM method this
   machine runs (orca_mq/engine/gemm.py), interleaved; the floor takes the fastest.
2. Memory read bandwidth (a sum over 512 MiB) and the time to read the weights once.
3. The engine's decode iteration (plan -> sampled tokens, kv 256) at b=1 against reading the weights
   once, and at b=max_bs against its GEMM time.
4. A trace's GEMM floor (orca_mq/bench/floor.py: prompt tokens at the chunk rate, generated tokens at
   the decode rate, the LM head once per generated token), then the trace served by a whole server
   (ZeroMQ client, greedy, generation forced), and makespan / floor.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from orca_mq.bench.bench_server import on_sigterm
from orca_mq.bench.floor import measure_gemms, read_bandwidth, trace_floor, weight_bytes
from orca_mq.bench.metrics import summarize
from orca_mq.bench.plans import plan_for
from orca_mq.bench.replay import replay
from orca_mq.bench.timing import median_time
from orca_mq.bench.trace import TraceSpec, load_corpus, make_trace, parse_range
from orca_mq.config import Config, load_config
from orca_mq.engine import gemm
from orca_mq.engine.model_runner import DTYPES, ModelRunner
from orca_mq.engine.dtype import resolve_dtype
from orca_mq.models.registry import read_model_info
from orca_mq.runtime.threads import use_threads
from orca_mq.models.weights import load_stage_weights
from orca_mq.server.process import free_port, spawn

KV = 255   # cached tokens of every decode request


def serve(cfg_sets: list[str], trace: list, log: Path) -> dict[str, Any]:
    sets = {"server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "server.http_address": "",
            "log.dir": str(log.with_suffix(".logs")), "log.level": "warning", **dict(s.split("=", 1) for s in cfg_sets)}
    handle = spawn(sets, log.with_suffix(".launch.log"), ready_timeout=600)
    try:
        records, _ = asyncio.run(replay(handle.address, trace, progress=False, warmup=2))
    finally:
        handle.stop(60)
    summary = summarize(records)
    if summary["n_errors"]:
        raise RuntimeError(f"{summary['n_errors']} requests failed, e.g. {next(r['error'] for r in records if r['error'])}")
    return summary


def engine_decode(cfg: Config, batches: list[int], repeat: int) -> dict[int, float]:
    """Seconds of one decode iteration (execute: forward + sampling) per batch size."""
    runner = ModelRunner(cfg)
    out = {}
    for b in batches:
        plan = plan_for([(1, KV)] * b, runner.block_size)
        out[b] = median_time(lambda: runner.execute(plan), repeat)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value", help="config, for the engine and the server")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--input-len", type=parse_range, default=(32, 512))
    ap.add_argument("--output-len", type=parse_range, default=(1, 128))
    ap.add_argument("--seed", type=int, default=1721, help="trace seed (1721: 12,171 prompt and 3,637 generated tokens)")
    ap.add_argument("--rounds", type=int, default=1, help="served runs of the trace (the median makespan is used)")
    ap.add_argument("--no-serve", action="store_true", help="rates, engine and the floor only")
    ap.add_argument("--out", default="results/bench_floor.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)   # so `finally` stops the server when this is terminated
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, ["engine.n_slots=32768", *args.set])
    use_threads(cfg.engine.threads_per_worker)
    info = read_model_info(cfg.model.path, cfg.model.cache_dir)
    dtype = DTYPES[resolve_dtype(cfg.model.dtype, "cpu")]
    bs, budget = cfg.scheduler.max_bs, cfg.scheduler.max_num_batched_tokens or 512
    rows = sorted({1, 8, bs, budget, 512})
    cpu = torch.device("cpu")
    methods: list[gemm.Method] = ["torch", *(["onednn"] if gemm.onednn_usable(cpu, dtype) else []),
                                  *(["stream"] if gemm.stream_usable(cpu, dtype) else [])]
    weights = load_stage_weights(info, range(info.n_layers), True, True, dtype, cfg.model.cache_dir)
    print(f"{info.n_layers} layers, dtype {dtype}, {torch.get_num_threads()} threads, GEMM methods {methods}", flush=True)
    rates = measure_gemms(weights, methods, rows, args.repeat)
    layer_b, head_b = weight_bytes(weights)
    del weights
    bw = read_bandwidth(args.repeat)
    read_once = (layer_b + head_b) / bw
    print(f"\n{'M':>5} " + " ".join(f"{m + ' layers ms':>17} {m + ' head ms':>15}" for m in methods)
          + f" {'best GFLOP/s':>13} {'us/token':>9}")
    for m in rows:
        best = rates.best_layers(m) + rates.best_head(m)
        print(f"{m:>5} " + " ".join(f"{rates.layers[m][k] * 1e3:>17.2f} {rates.head[m][k] * 1e3:>15.2f}" for k in methods)
              + f" {rates.gflops(m, best, rates.layer_params + rates.head_params):>13.1f} {best / m * 1e6:>9.1f}")
    print(f"\nmemory read {bw / 1e9:.1f} GB/s; weights {layer_b / 2**20:.0f} MiB layers + {head_b / 2**20:.0f} MiB LM head: "
          f"read once in {read_once * 1e3:.1f} ms")

    decode = engine_decode(cfg, [1, bs], args.repeat)
    gemm_bs = rates.best_layers(bs) + rates.best_head(bs)
    targets = {"decode_b1_over_read_once": decode[1] / read_once, f"decode_b{bs}_over_gemm": decode[bs] / gemm_bs}
    print(f"decode b=1: {decode[1] * 1e3:.1f} ms = {targets['decode_b1_over_read_once']:.2f}x reading the weights once (target <= 1.5x)")
    print(f"decode b={bs}: {decode[bs] * 1e3:.1f} ms = {targets[f'decode_b{bs}_over_gemm']:.2f}x its GEMMs "
          f"({gemm_bs * 1e3:.1f} ms; target <= 1.6x)")

    from orca_mq.tokenizer import load_tokenizer

    spec = TraceSpec(kind="orca", num_requests=args.requests, rate=0.0, input_len=args.input_len,
                     output_len=args.output_len, seed=args.seed)
    trace = make_trace(spec, load_corpus(load_tokenizer(cfg.model.path, cfg.model.cache_dir)))
    floor = trace_floor([(r.input_len, r.max_tokens) for r in trace], rates, budget, bs, read_once)
    print(f"\ntrace: {args.requests} requests at t=0, {floor.prompt_tokens} prompt + {floor.generated_tokens} generated tokens")
    print(f"GEMM floor {floor.gemm_s:.2f} s = prompts {floor.prompt_s:.2f} s (M={budget}) + decodes {floor.decode_s:.2f} s "
          f"+ LM head {floor.head_s:.2f} s (M={bs}); bandwidth floor {floor.bandwidth_s:.2f} s "
          f"({floor.min_iterations} iterations x {read_once * 1e3:.1f} ms)")
    served = []
    for r in range(0 if args.no_serve else args.rounds):
        served.append(serve(args.set, trace, out.with_name(f"{out.stem}.serve{r}")))
        print(f"served round {r}: makespan {served[-1]['makespan_s']:.2f} s = {served[-1]['makespan_s'] / floor.gemm_s:.2f}x "
              f"the GEMM floor (target <= 2.5x)", flush=True)
    if served:
        targets["makespan_over_gemm_floor"] = statistics.median(s["makespan_s"] for s in served) / floor.gemm_s
    out.write_text(json.dumps({
        "config": cfg.to_dict(), "dtype": str(dtype), "threads": torch.get_num_threads(), "methods": methods,
        "gemm_ms": {m: {"layers": {k: v * 1e3 for k, v in rates.layers[m].items()},
                        "head": {k: v * 1e3 for k, v in rates.head[m].items()}} for m in rows},
        "layer_params": rates.layer_params, "head_params": rates.head_params,
        "read_gb_s": bw / 1e9, "read_once_ms": read_once * 1e3, "decode_ms": {b: t * 1e3 for b, t in decode.items()},
        "trace": {"requests": args.requests, "seed": args.seed, "input_len": args.input_len, "output_len": args.output_len},
        "floor": {"gemm_s": floor.gemm_s, "prompt_s": floor.prompt_s, "decode_s": floor.decode_s, "head_s": floor.head_s,
                  "bandwidth_s": floor.bandwidth_s, "min_iterations": floor.min_iterations,
                  "prompt_tokens": floor.prompt_tokens, "generated_tokens": floor.generated_tokens},
        "served": served, "ratios": targets}, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
