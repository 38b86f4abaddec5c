"""MoE benchmark (issue 40): a mixture of experts' iteration against a dense model of equal active
parameters on the CPU, per token. Prints a table and writes JSON.

Two random-weight checkpoints built here (transformers' own Qwen3-MoE and Qwen3 configs): the same
attention, embeddings and LM head; the MoE's layers route each token to top_k of n_experts experts of
--moe-intermediate, the dense model's MLP is top_k x that wide, so a token passes through the same
parameters (the router aside). Both run through the real ModelRunner, interleaved round by round (a
shared machine's load hits both alike), on decode at batch 1 and 32 and a prompt. The target: MoE <= 1.5x
the dense per token. A batch spreads over more experts than one token: the table gives each iteration's
expected weight bytes read, the floor where the weights' reading is the cost.

    python tools/bench_moe.py --out results/bench_moe.json
    python tools/bench_moe.py --hidden 768 --experts 32 --set engine.threads_per_worker=1
    python tools/bench_moe.py --crossover   # the grouped kernel alone: rows per expert streamed vs one product (oneDNN for float32)
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from orca_mq.bench.plans import plan_for
from orca_mq.bench.random_models import save_random_model
from orca_mq.bench.timing import interleaved_medians
from orca_mq.config import load_config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.models.info import ModelInfo

CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("decode b=1 kv=256", [(1, 255)]),
    ("decode b=32 kv=256", [(1, 255)] * 32),
    ("prefill 512", [(512, 0)]),
]
TARGET = 1.5


def checkpoints(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
                  max_position_embeddings=2048, tie_word_embeddings=True)
    return {"moe": save_random_model(root / "moe", Qwen3MoeConfig(
                **common, num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                moe_intermediate_size=args.moe_intermediate, intermediate_size=args.top_k * args.moe_intermediate)),
            "dense": save_random_model(root / "dense", Qwen3Config(
                **common, intermediate_size=args.top_k * args.moe_intermediate))}


def weights_read(info: ModelInfo, tokens: int, itemsize: int) -> float:
    """Bytes of weights (`itemsize` bytes each) an iteration of `tokens` routed tokens reads (uniform
    routing: the experts expected to get at least one), embeddings aside (a gather)."""
    h = info.hidden_size
    per_layer = info.layer_params(0)
    if info.moe is not None:
        e, k = info.moe.n_experts, info.moe.top_k
        active = e * (1 - (1 - k / e) ** tokens)
        per_layer += 3 * h * info.moe.intermediate_size * (active - k)
    return itemsize * (info.n_layers * per_layer + info.vocab_size * h)


def compare(runners: dict[str, ModelRunner], repeat: int) -> list[dict]:
    rows = []
    for name, reqs in CASES:
        plan = plan_for(reqs, runners["moe"].block_size)
        times = dict(zip(runners, interleaved_medians([lambda r=r: r.forward(plan) for r in runners.values()], repeat)))
        tokens = sum(q for q, _ in reqs)
        read = {m: weights_read(r.info, tokens, r.dtype.itemsize) for m, r in runners.items()}
        ratio = times["moe"] / times["dense"]
        rows.append({"case": name, "tokens": tokens, "moe_ms": times["moe"] * 1e3, "dense_ms": times["dense"] * 1e3,
                     "moe_ms_per_token": times["moe"] * 1e3 / tokens,
                     "dense_ms_per_token": times["dense"] * 1e3 / tokens,
                     "ratio": ratio, "met": ratio <= TARGET, "moe_mib_read": read["moe"] / 2**20,
                     "dense_mib_read": read["dense"] / 2**20, "read_ratio": read["moe"] / read["dense"]})
        print(f"  {name}: moe {times['moe'] * 1e3:.1f} ms, dense {times['dense'] * 1e3:.1f} ms", flush=True)
    return rows


def crossover(args: argparse.Namespace) -> list[dict]:
    """grouped_rows over 16 experts' gate_up [2I, H] at each number of rows per expert: every expert's
    rows streamed against one product each, oneDNN for float32 (moe.py's STREAM_ROWS is where they cross)."""
    from kernels import cpu_kernels

    ext = cpu_kernels.load()
    if ext is None:
        raise SystemExit("the CPU extension could not be built here")
    e, w = 16, torch.randn(16, 2 * args.moe_intermediate, args.hidden)
    rows = []
    for n in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64):
        x, ends = torch.randn(e * n, args.hidden), torch.arange(1, e + 1) * n
        product, stream = interleaved_medians([lambda: ext.grouped_rows(x, w, ends, 0),
                                               lambda: ext.grouped_rows(x, w, ends, 1 << 30)], args.repeat)
        rows.append({"rows_per_expert": n, "product_ms": product * 1e3, "stream_ms": stream * 1e3,
                     "stream_vs_product": stream / product})
        print(f"  {n:3d} rows/expert: product {product * 1e3:7.2f} ms, streamed {stream * 1e3:7.2f} ms "
              f"({stream / product:.2f}x)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=384,
                    help="each expert's (Qwen3-30B-A3B: 768 at hidden 2048)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096, help="small: the LM head, alike in both, would hide the layers")
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value", help="engine config for both")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--crossover", action="store_true", help="only the grouped kernel's streamed-vs-product table")
    ap.add_argument("--out", default="results/bench_moe.json")
    args = ap.parse_args()
    shape = {k: getattr(args, k) for k in ("hidden", "experts", "top_k", "moe_intermediate", "layers", "vocab")}
    if args.crossover:
        torch.set_num_threads(load_config(None, args.set).engine.threads_per_worker)
        result: dict = {"shape": shape, "threads": torch.get_num_threads(), "crossover": crossover(args)}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            paths = checkpoints(Path(tmp), args)
            cfgs = {m: load_config(None, ["engine.n_slots=32768", "model.dtype=float32", f"model.path={p}", *args.set])
                    for m, p in paths.items()}
            runners = {m: ModelRunner(c) for m, c in cfgs.items()}
        torch.set_num_threads(cfgs["moe"].engine.threads_per_worker)
        print(f"{shape}, {runners['moe'].dtype}, {torch.get_num_threads()} threads, gemm {runners['moe'].gemm}", flush=True)
        rows = compare(runners, args.repeat)
        print(f"{'case':20} {'MoE ms/tok':>10} {'dense ms/tok':>12} {'MoE/dense':>9} {'target':>7} "
              f"{'MiB read MoE/dense':>19} {'read ratio':>10}")
        for r in rows:
            print(f"{r['case']:20} {r['moe_ms_per_token']:10.3f} {r['dense_ms_per_token']:12.3f} {r['ratio']:9.2f} "
                  f"{'met' if r['met'] else 'NOT':>7} {r['moe_mib_read']:9.0f}/{r['dense_mib_read']:<9.0f} "
                  f"{r['read_ratio']:10.2f}")
        result = {"shape": shape, "threads": torch.get_num_threads(), "config": cfgs["moe"].to_dict(), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
