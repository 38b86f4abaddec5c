"""Engine benchmark: time of one iteration vs batch composition, against transformers and this machine's ceiling.

Prints a table and writes JSON. Every figure comes from this one run: the machine's fp32 matmul
GFLOP/s, our engine (selective batching over the paged KV pool) and transformers' own fp32 forward
on the same shapes, so ratios hold even on a noisy shared machine. Times are medians. Engine
variants (`--variant NAME:key=value,...`, e.g. a dtype) run interleaved with the base config and
transformers, round by round; their weight memory is reported too.

    python tools/bench_engine.py --out results/bench_engine.json
    python tools/bench_engine.py --variant bf16:model.dtype=bfloat16 --variant torch:engine.attention_backend=torch
    python tools/bench_engine.py --no-transformers --cases "decode b=32,decode b=64,mixed 1x128" --profile
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from orca_mq.bench.plans import plan_for
from orca_mq.bench.timing import interleaved_medians, median_time
from orca_mq.bench.weights import weight_bytes
from orca_mq.config import load_config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.models.info import ModelInfo

# (name, [(prompt tokens this iteration, cached tokens before)] per request)
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("decode b=1 kv=256", [(1, 255)]),
    ("decode b=4 kv=256", [(1, 255)] * 4),
    ("decode b=8 kv=256", [(1, 255)] * 8),
    ("decode b=16 kv=256", [(1, 255)] * 16),
    ("decode b=32 kv=256", [(1, 255)] * 32),
    ("decode b=64 kv=256", [(1, 255)] * 64),
    ("prefill 128", [(128, 0)]),
    ("prefill 512", [(512, 0)]),
    ("mixed 1x128 prefill + 31 decodes", [(128, 0)] + [(1, 255)] * 31),
    ("mixed 2x256 prefill + 62 decodes", [(256, 0)] * 2 + [(1, 255)] * 62),
    # chunked prefill: a 512-token prompt beside 31 decodes, whole or in chunks (each chunk's iteration
    # is the decodes' stall; the chunks' sum against the whole is what chunking costs)
    ("chunk: 512 whole + 31 decodes", [(512, 0)] + [(1, 255)] * 31),
    ("chunk: 256 of 512 @0 + 31 decodes", [(256, 0)] + [(1, 255)] * 31),
    ("chunk: 256 of 512 @256 + 31 decodes", [(256, 256)] + [(1, 255)] * 31),
    ("chunk: 128 of 512 @384 + 31 decodes", [(128, 384)] + [(1, 255)] * 31),
]


def matmul_ceiling(repeat: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / median_time(lambda: a @ b, repeat) / 1e9


def iteration_flops(info: ModelInfo, reqs: list[tuple[int, int]]) -> float:
    h, d, i = info.hidden_size, info.head_dim, info.intermediate_size
    per_token = 2 * info.n_layers * (h * (info.n_heads + 2 * info.n_kv_heads) * d + h * h + 3 * h * i)
    tokens = sum(q for q, _ in reqs)
    attn = sum(4 * info.n_layers * info.n_heads * d * sum(ctx + j + 1 for j in range(q)) for q, ctx in reqs)
    return per_token * tokens + attn + 2 * h * info.vocab_size * len(reqs)


def ours_step(runner: ModelRunner, reqs: list[tuple[int, int]]):
    plan = plan_for(reqs, runner.block_size)
    return lambda: runner.forward(plan)


def op_profile(runner: ModelRunner, reqs: list[tuple[int, int]], iterations: int = 5, top: int = 8) -> list[dict]:
    """The torch ops with the most self CPU time in one iteration (ms). What the profiler does not see:
    the C++ decode kernel (an extension function, not a dispatcher op) and Python."""
    from torch.profiler import ProfilerActivity, profile

    step = ours_step(runner, reqs)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iterations):
            step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "ms": e.self_cpu_time_total / 1e3 / iterations} for e in events]


def transformers_step(model, reqs: list[tuple[int, int]]):
    """transformers' forward on the same shapes: a uniform batch (decode with a DynamicCache cropped back
    after every step, or a prefill); mixed batches have no transformers equivalent without padding."""
    from transformers import DynamicCache

    if model is None or len(set(reqs)) != 1:
        return None
    (q, ctx), b = reqs[0], len(reqs)
    if ctx == 0:
        ids = torch.full((b, q), 11)
        return torch.no_grad()(lambda: model(ids, use_cache=False, logits_to_keep=1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.full((b, ctx), 11), past_key_values=cache, use_cache=True)

    @torch.no_grad()
    def step() -> None:
        model(torch.full((b, 1), 7), past_key_values=cache, use_cache=True)
        cache.crop(-1)  # back to ctx tokens: every step sees the same cache

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", default="results/bench_engine.json")
    ap.add_argument("--cases", default="", help="comma-separated substrings: run only the cases whose name has one")
    ap.add_argument("--across-cases", action="store_true",
                    help="interleave the selected cases themselves (base engine only), to compare cases on a noisy machine")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...",
                    help="an engine config beside the base one (--set applies to both), timed interleaved")
    ap.add_argument("--profile", action="store_true", help="also print each case's top torch ops (base engine)")
    args = ap.parse_args()
    cfg = load_config(args.config, ["engine.n_slots=32768", *args.set])
    cfg.engine.n_workers = 1
    runners = {"ours": ModelRunner(cfg)}
    for spec in args.variant:
        name, _, sets = spec.partition(":")
        runners[name] = ModelRunner(load_config(args.config, ["engine.n_slots=32768", *args.set, *sets.split(",")]))
    torch.set_num_threads(cfg.engine.threads_per_worker)
    ref = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        from orca_mq.models.files import resolve_model_path

        p = resolve_model_path(cfg.model.path)
        ref = (AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32) if p.is_file()
               else AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)).eval()
    memory = {name: {"dtype": str(r.dtype).removeprefix("torch."), "attention": r.model.attention_backend,
                     "weight_mb": weight_bytes(r) / 2**20} for name, r in runners.items()}
    for name, m in memory.items():
        print(f"{name}: {m['dtype']}, attention {m['attention']}, weights {m['weight_mb']:.0f} MiB", flush=True)
    ceiling = matmul_ceiling(args.repeat)
    print(f"matmul ceiling (fp32 2048^3, {torch.get_num_threads()} threads): {ceiling:.1f} GFLOP/s", flush=True)
    rows = []
    chosen = [(name, reqs) for name, reqs in CASES if not args.cases or any(c in name for c in args.cases.split(","))]

    def row(label: str, runner: ModelRunner, name: str, reqs: list[tuple[int, int]], ours: float,
            theirs: float | None) -> dict:
        tokens, gflops = sum(q for q, _ in reqs), iteration_flops(runner.info, reqs) / ours / 1e9
        return {"engine": label, "case": name, "batch": len(reqs), "tokens": tokens, "ms": ours * 1e3,
                "tok_s": tokens / ours, "gflop_s": gflops, "frac_of_ceiling": gflops / ceiling,
                "transformers_ms": theirs and theirs * 1e3, "transformers_tok_s": theirs and tokens / theirs,
                "speedup_vs_transformers": theirs and theirs / ours}

    if args.across_cases:
        times = interleaved_medians([ours_step(runners["ours"], reqs) for _, reqs in chosen], args.repeat)
        rows = [row("ours", runners["ours"], name, reqs, t, None) for (name, reqs), t in zip(chosen, times)]
    for name, reqs in [] if args.across_cases else chosen:
        hf = transformers_step(ref, reqs)
        steps = [ours_step(r, reqs) for r in runners.values()] + ([hf] if hf else [])
        times = interleaved_medians(steps, args.repeat)
        theirs = times[len(runners)] if hf else None
        rows += [row(label, runner, name, reqs, ours, theirs) for (label, runner), ours in zip(runners.items(), times)]
        print(f"  {name}: " + ", ".join(f"{label} {t * 1e3:.1f} ms" for label, t in zip(runners, times))
              + (f", transformers {theirs * 1e3:.1f} ms" if theirs else ""), flush=True)
    print(f"{'engine':8} {'case':36} {'ms':>8} {'tok/s':>8} {'GFLOP/s':>8} {'%ceil':>6} {'HF tok/s':>9} {'x HF':>6}")
    for r in rows:
        hf = f"{r['transformers_tok_s']:9.0f} {r['speedup_vs_transformers']:6.2f}" if r["transformers_tok_s"] else f"{'-':>9} {'-':>6}"
        print(f"{r['engine']:8} {r['case']:36} {r['ms']:8.1f} {r['tok_s']:8.0f} {r['gflop_s']:8.1f} "
              f"{100 * r['frac_of_ceiling']:5.0f}% {hf}")
    profiles = {name: op_profile(runners["ours"], reqs) for name, reqs in chosen} if args.profile else {}
    for r in rows:   # shares of the timed (unprofiled) median iteration
        if r["engine"] == "ours" and r["case"] in profiles:
            ops = profiles[r["case"]]
            print(f"profile, {r['case']} ({r['ms']:.1f} ms): " + ", ".join(
                f"{o['op'].removeprefix('aten::')} {o['ms']:.1f} ms ({100 * o['ms'] / r['ms']:.0f}%)" for o in ops)
                + f"; not seen by the profiler (C++ decode kernel, Python): {r['ms'] - sum(o['ms'] for o in ops):.1f} ms")
    ceiling = max(ceiling, matmul_ceiling(args.repeat))  # best of start and end: the ceiling is what the machine can do
    print(f"matmul ceiling, best of start and end: {ceiling:.1f} GFLOP/s")
    for r in rows:
        r["frac_of_ceiling"] = r["gflop_s"] / ceiling
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": cfg.to_dict(), "variants": args.variant, "engines": memory,
                               "matmul_ceiling_gflop_s": ceiling, "threads": torch.get_num_threads(),
                               "rows": rows, "profiles": profiles}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
