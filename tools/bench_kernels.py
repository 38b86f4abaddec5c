#!/usr/bin/env python
"""Time the Triton selective-batching kernels against their torch references.

On a CUDA device (the real use):
    python tools/bench_kernels.py --out bench_kernels.json [--dtype float16|bfloat16|float32]
times every kernel and its ``*_ref`` (plus the attention kernel against a
fairer per-request SDPA loop, and ``rotary_write_kv`` against the rotary and
write_kv launches it fuses: rel_err 0 expected there) with ``triton.testing.do_bench`` (median
ms) on shapes of the embedded model (hidden 576, 9 query / 3 KV heads,
head_dim 64, block_size 16), checks the outputs against the refs (max|a-b| /
max|b|), prints a table and writes JSON.

Without CUDA it prints a message and exits 0, unless ``--interpret``: then it
sets TRITON_INTERPRET=1 (before importing triton) and runs a tiny CPU smoke
check (correctness + wall time; interpreter times mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

from orca_mq.bench.plans import blocks_for  # imports neither torch nor triton (see --interpret)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write results as JSON to this path")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--interpret", action="store_true",
                    help="no GPU: run a tiny correctness/smoke check under TRITON_INTERPRET=1 on CPU")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    ap.add_argument("--skip-ref-attention", action="store_true",
                    help="don't time the (slow, per-request Python loop) attention reference")
    return ap.parse_args(argv)


# (name, [(ctx, q_len) per request]) -- ctx = tokens already cached, q_len = new tokens
def scenarios(interpret: bool):
    if interpret:
        return [
            ("decode_b4_kv20", [(19, 1)] * 4),
            ("prefill_24", [(0, 24)]),
            ("mixed_2prefill_3decode", [(0, 9), (5, 7)] + [(14, 1)] * 3),
        ]
    return [
        ("decode_b1_kv2048", [(2047, 1)]),  # 3 programs walk 32 KV chunks each: does split-KV pay?
        ("decode_b64_kv256", [(255, 1)] * 64),
        ("prefill_512", [(0, 512)]),
        ("prefill_4x128", [(0, 128)] * 4),
        ("mixed_4x128prefill_60decode_kv256", [(0, 128)] * 4 + [(255, 1)] * 60),
    ]


def model_shape(interpret: bool):
    if interpret:
        return dict(hidden=48, n_heads=9, n_kv_heads=3, head_dim=16, intermediate=40)
    return dict(hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, intermediate=1536)  # embedded model


def build(reqs, shape, block_size, dtype, device, gen):
    import torch

    H, KVH, d = shape["n_heads"], shape["n_kv_heads"], shape["head_dim"]
    seq = [c + q for c, q in reqs]
    nblk = [blocks_for(s, block_size) for s in seq]
    num_blocks = sum(nblk) + 1
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # shuffled, non-contiguous
    B = len(reqs)
    bt = torch.zeros(B, max(nblk), dtype=torch.int32)
    slots, i = [], 0
    for b, (c, q) in enumerate(reqs):
        blocks = perm[i:i + nblk[b]]
        i += nblk[b]
        bt[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    T = sum(q for _, q in reqs)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([q for _, q in reqs]), 0)
    positions = torch.cat([torch.arange(c, c + q) for c, q in reqs])
    max_pos = max(seq) + 1
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    emb = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq).repeat(1, 2)

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(dtype).to(device)

    q, k, v = rnd(T, H, d), rnd(T, KVH, d), rnd(T, KVH, d)
    return dict(
        T=T, q=q, k=k, v=v, qkv=torch.cat([q, k, v], dim=1).view(T, -1),  # the fused QKV projection's output
        gate_up=rnd(T, 2 * shape["intermediate"]),
        k_cache=rnd(num_blocks, block_size, KVH, d), v_cache=rnd(num_blocks, block_size, KVH, d),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=bt.to(device), cu_q_lens=cu.to(device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device), positions=positions.to(device),
        cos=emb.cos().to(dtype).to(device), sin=emb.sin().to(dtype).to(device),
        x=rnd(T, shape["hidden"]), residual=rnd(T, shape["hidden"]),
        w=(1 + 0.1 * torch.randn(shape["hidden"], generator=gen)).to(dtype).to(device),
        scale=d ** -0.5,
    )


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def sdpa_attention(q, k_cache, v_cache, block_tables, cu_q_lens, seq_lens, scale):
    """A fair torch baseline (not the ground truth): per request, vectorised block-table
    gather + F.scaled_dot_product_attention with a bottom-right causal mask."""
    import torch
    import torch.nn.functional as F

    nb, bs, kvh, d = k_cache.shape
    G = q.shape[1] // kvh
    kf, vf = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    out = torch.empty_like(q)
    cu, sl = cu_q_lens.tolist(), seq_lens.tolist()
    for b in range(len(sl)):
        q0, q1, S = cu[b], cu[b + 1], sl[b]
        pos = torch.arange(S, device=q.device)
        slots = block_tables[b, pos // bs].long() * bs + pos % bs
        k = kf[slots].transpose(0, 1).repeat_interleave(G, dim=0)
        v = vf[slots].transpose(0, 1).repeat_interleave(G, dim=0)
        L = q1 - q0
        mask = pos[None, :] <= (S - L + torch.arange(L, device=q.device))[:, None]
        out[q0:q1] = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k, v, attn_mask=mask,
                                                    scale=scale).transpose(0, 1)
    return out


def rotary_then_write_kv(kernels, qkv, positions, cos, sin, slots, k_cache, v_cache, n_heads, n_kv_heads):
    """What ``rotary_write_kv`` fuses: the rotary and KV-write kernels on the fused QKV's slices."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    q, k = kernels.rotary(qkv[:, :n_heads * d].view(t, n_heads, d),
                          qkv[:, n_heads * d:(n_heads + n_kv_heads) * d].view(t, n_kv_heads, d), positions, cos, sin)
    kernels.write_kv(k, qkv[:, (n_heads + n_kv_heads) * d:].view(t, n_kv_heads, d), k_cache, v_cache, slots)


BASELINES = {"attention_vs_sdpa_loop": "sdpa_loop", "rotary_write_kv_vs_2_kernels": "rotary+write_kv"}


def cases(t, kernels):
    """(kernel name, triton fn, baseline fn) for one scenario's tensors ``t``."""
    heads = (t["q"].shape[1], t["k"].shape[1])

    def rope_kv(fn):
        """``fn`` (a rotary_write_kv: in place) on its own copy of the QKV and the caches; returns the K cache."""
        qkv, kc, vc = t["qkv"].clone(), t["k_cache"].clone(), t["v_cache"].clone()
        return lambda: (fn(qkv, t["positions"], t["cos"], t["sin"], t["slot_mapping"], kc, vc, *heads), kc)[1]

    kc, vc = t["k_cache"].clone(), t["v_cache"].clone()
    kc_ref, vc_ref = t["k_cache"].clone(), t["v_cache"].clone()
    attn_args = (t["block_tables"], t["cu_q_lens"], t["seq_lens"], t["scale"])
    return [  # (name, triton fn, baseline fn); both return the tensor compared for rel_err
        ("write_kv",
         lambda: (kernels.write_kv(t["k"], t["v"], kc, vc, t["slot_mapping"]), kc)[1],
         lambda: (kernels.write_kv_ref(t["k"], t["v"], kc_ref, vc_ref, t["slot_mapping"]), kc_ref)[1]),
        ("ragged_paged_attention",
         lambda: kernels.ragged_paged_attention(t["q"], t["k_cache"], t["v_cache"], *attn_args),
         lambda: kernels.ragged_paged_attention_ref(t["q"], t["k_cache"], t["v_cache"], *attn_args)),
        ("attention_vs_sdpa_loop",  # same kernel, against a fair torch baseline instead of the slow ref
         lambda: kernels.ragged_paged_attention(t["q"], t["k_cache"], t["v_cache"], *attn_args),
         lambda: sdpa_attention(t["q"], t["k_cache"], t["v_cache"], *attn_args)),
        ("rms_norm",
         lambda: kernels.rms_norm(t["x"], t["w"], 1e-5),
         lambda: kernels.rms_norm_ref(t["x"], t["w"], 1e-5)),
        ("fused_add_rms_norm",
         lambda: kernels.fused_add_rms_norm(t["x"], t["residual"], t["w"], 1e-5)[0],
         lambda: kernels.fused_add_rms_norm_ref(t["x"], t["residual"], t["w"], 1e-5)[0]),
        ("rotary",
         lambda: kernels.rotary(t["q"], t["k"], t["positions"], t["cos"], t["sin"])[0],
         lambda: kernels.rotary_ref(t["q"], t["k"], t["positions"], t["cos"], t["sin"])[0]),
        ("rotary_write_kv", rope_kv(kernels.rotary_write_kv), rope_kv(kernels.rotary_write_kv_ref)),
        ("rotary_write_kv_vs_2_kernels",  # today's two launches: equal bits expected, in every dtype
         rope_kv(kernels.rotary_write_kv), rope_kv(functools.partial(rotary_then_write_kv, kernels))),
        ("silu_mul", lambda: kernels.silu_mul(t["gate_up"]), lambda: kernels.silu_mul_ref(t["gate_up"])),
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("bench_kernels: no CUDA device -- nothing to time. The Triton kernels need a GPU "
              "(or run `python tools/bench_kernels.py --interpret` for a slow CPU smoke check).")
        return 0
    try:
        import triton
    except ImportError:
        print("bench_kernels: triton is not installed -- nothing to time.")
        return 0
    import kernels

    device = "cpu" if args.interpret else "cuda"
    dtype = torch.float32 if args.interpret else getattr(torch, args.dtype)
    shape = model_shape(args.interpret)
    gen = torch.Generator().manual_seed(0)
    if args.interpret:
        torch.set_num_threads(1)

    def timed(fn):
        if args.interpret:  # one run, wall time (meaningless for performance)
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    rows = []
    for scen, reqs in scenarios(args.interpret):
        t = build(reqs, shape, args.block_size, dtype, device, gen)
        for name, tri, ref in cases(t, kernels):
            err = rel_err(tri(), ref())
            tri_ms = timed(tri)
            skip_ref = name == "ragged_paged_attention" and args.skip_ref_attention
            ref_ms = float("nan") if skip_ref else timed(ref)
            rows.append(dict(scenario=scen, kernel=name, tokens=t["T"], requests=len(reqs),
                             baseline=BASELINES.get(name, "ref"),
                             triton_ms=tri_ms, ref_ms=ref_ms,
                             speedup=ref_ms / tri_ms if tri_ms > 0 else float("nan"), rel_err=err))

    hdr = f"{'scenario':36s} {'kernel':28s} {'T':>5s} {'triton ms':>10s} {'base ms':>10s} {'speedup':>8s} {'rel_err':>9s}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['scenario']:36s} {r['kernel']:28s} {r['tokens']:5d} {r['triton_ms']:10.4f} "
              f"{r['ref_ms']:10.4f} {r['speedup']:8.1f} {r['rel_err']:9.2e}")
    meta = dict(
        device="cpu (TRITON_INTERPRET=1, times meaningless)" if args.interpret else torch.cuda.get_device_name(),
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        dtype=str(dtype).replace("torch.", ""), block_size=args.block_size, model_shape=shape,
        timer="perf_counter, 1 run" if args.interpret else "triton.testing.do_bench median ms",
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=2)
        print(f"wrote {args.out}")
    worst = max(r["rel_err"] for r in rows)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if not worst <= tol:
        print(f"bench_kernels: WARNING max rel_err {worst:.3g} > {tol:g} -- a kernel disagrees with its reference")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
