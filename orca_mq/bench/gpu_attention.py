"""tools/gpu_check.py's `decode`, `tune` and `splitkv` sections (issue 42, item 3): attention at long contexts.

Llama 3 8B's attention (32 query heads over 8 KV heads of 128, blocks of 16, bf16), random KV on
shuffled blocks. Decode rows: the split-KV kernel beside the ragged one at contexts of 1k-32k, each
kernel's KV bytes over its time against the card's copy bandwidth, measured in the same run (a
device-to-device copy: bytes read + written over its time); e4m3 KV at the longest context (its
bytes and its error against bf16), the e4m3 write's bytes against torch's. Prompts: the ragged
kernel at head_dim 128 beside SDPA's causal attention over the same keys (its FLOPs over its time).
Kernel times are triton.testing.do_bench's medians (L2 flushed between runs) on a GPU. `tune`:
the split kernel's launch shapes swept at the longest context. `splitkv`: the engine's decode
iteration with engine.split_kv auto against off (the random model).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from orca_mq.bench.gpu_context import Ctx

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CONTEXTS, SMALL_CONTEXTS = (1024, 4096, 8192, 16384, 32768), (48, 160)
BATCHES, SMALL_BATCHES = (1, 4), (1, 2)
PROMPTS, SMALL_PROMPTS = (2048, 8192), (48,)
TARGET = 0.70   # of the copy bandwidth, at the longest context (issue 42)


def kernel_ms(ctx: Ctx, fn: Callable[[], object]) -> float:
    if ctx.cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40))
    return ctx.timed_ms(fn, 2)


def copy_bandwidth(ctx: Ctx) -> float:
    """Bytes per second a device-to-device copy of 1 GiB moves (read + written)."""
    n = (1 << 30) if ctx.cuda else (16 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    return 2 * n / (kernel_ms(ctx, lambda: dst.copy_(src)) / 1e3)


def paged(ctx: Ctx, rows: int, context: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, Any]:
    """`rows` rows of `context` keys each on shuffled blocks of a pool just big enough."""
    per = -(-context // BLOCK)
    nb = rows * per + 1
    tables = (torch.randperm(nb - 1, generator=gen) + 1)[: rows * per].view(rows, per).to(torch.int32)
    shape = (nb, BLOCK, KV_HEADS, HEAD_DIM)   # made on the device (torch's generator there, seeded by the section)
    k = torch.randn(shape, device=ctx.device).to(dtype)
    v = torch.randn(shape, device=ctx.device).to(dtype)
    return {"q": torch.randn(rows, HEADS, HEAD_DIM, device=ctx.device).to(dtype), "k_cache": k,
            "v_cache": v, "tables": tables.to(ctx.device),
            "seq_lens": torch.full((rows,), context, dtype=torch.int32, device=ctx.device)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def decode(ctx: Ctx) -> None:
    if not ctx.cuda:   # the kernels run under the interpreter (before triton is first imported)
        os.environ["TRITON_INTERPRET"] = "1"
    from kernels.attention_kernel import ragged_paged_attention
    from kernels.split_kv_kernel import choose_splits, sm_count, split_kv_decode

    torch.manual_seed(42)
    bw = copy_bandwidth(ctx)
    ctx.emit("copy bandwidth (device to device, read + written)", bw / 1e9, unit="GB/s",
             how="torch copy_ of 1 GiB, triton.testing.do_bench median")
    contexts, batches = (CONTEXTS, BATCHES) if ctx.cuda else (SMALL_CONTEXTS, SMALL_BATCHES)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator().manual_seed(42)
    scale = HEAD_DIM ** -0.5
    sms = sm_count(torch.device(ctx.device))
    for rows in batches:
        for context in contexts:
            with ctx.attempt(f"decode b={rows} ctx={context}"):
                c = paged(ctx, rows, context, dtype, gen)
                splits = max(2, choose_splits(rows, KV_HEADS, c["tables"].shape[1] * BLOCK, sms))
                args = (c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], scale)
                cu = torch.arange(rows + 1, dtype=torch.int32, device=ctx.device)
                split = kernel_ms(ctx, lambda: split_kv_decode(*args, splits))
                ragged = kernel_ms(ctx, lambda: ragged_paged_attention(c["q"], c["k_cache"], c["v_cache"], c["tables"],
                                                                      cu, c["seq_lens"], scale, True))
                err = rel_err(split_kv_decode(*args, splits),
                              ragged_paged_attention(c["q"], c["k_cache"], c["v_cache"], c["tables"], cu, c["seq_lens"], scale, True))
                kv_bytes = 2 * rows * context * KV_HEADS * HEAD_DIM * c["k_cache"].element_size()
                frac = kv_bytes / (split / 1e3) / bw
                last = context == contexts[-1]
                ctx.emit(f"decode attention b={rows} ctx={context}: split-KV / ragged ms (KV read / copy bandwidth)",
                         frac, unit="x", target=f">= {TARGET:.0%}" if last and ctx.cuda else None,
                         met=frac >= TARGET if last and ctx.cuda else None,
                         shown=f"{split:.3f} / {ragged:.3f} ms ({frac:.0%} vs {kv_bytes / (ragged / 1e3) / bw:.0%}), "
                               f"{splits} splits, err {err:.1g}",
                         how="kernels.split_kv_kernel vs kernels.attention_kernel, 32/8 heads of 128, "
                             f"{str(dtype).removeprefix('torch.')}; KV bytes / time / copy bandwidth",
                         split_ms=split, ragged_ms=ragged, splits=splits, kv_bytes=kv_bytes, rel_err_vs_ragged=err)
                del c
    with ctx.attempt("e4m3 KV"):
        fp8_kv(ctx, contexts[-1], batches[0], bw, gen, sms)
    for n in PROMPTS if ctx.cuda else SMALL_PROMPTS:
        with ctx.attempt(f"prefill {n}"):
            prefill(ctx, n, dtype, gen)


def fp8_kv(ctx: Ctx, context: int, rows: int, bw: float, gen: torch.Generator, sms: int) -> None:
    """The e4m3 write's bytes against torch's quantize_rows; the split kernel on e4m3 KV: its time,
    bytes (values and scales) against the copy bandwidth, and its error against the same keys in bf16."""
    from kernels.kv_fp8_kernel import write_kv_fp8
    from kernels.split_kv_kernel import choose_splits, split_kv_decode
    from orca_mq.engine.fp8 import quantize_rows

    c = paged(ctx, rows, context, torch.bfloat16 if ctx.cuda else torch.float32, gen)
    nb = c["k_cache"].shape[0]
    caches = [torch.empty(c["k_cache"].shape, dtype=torch.float8_e4m3fn, device=ctx.device) for _ in range(2)]
    scales = [torch.empty(nb, BLOCK, KV_HEADS, device=ctx.device) for _ in range(2)]
    slots = torch.arange(nb * BLOCK, device=ctx.device)
    write_kv_fp8(c["k_cache"].view(-1, KV_HEADS, HEAD_DIM), c["v_cache"].view(-1, KV_HEADS, HEAD_DIM), *caches, *scales, slots)
    q, s = quantize_rows(c["k_cache"])
    same = bool(torch.equal(caches[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(scales[0], s.squeeze(-1)))
    ctx.emit("e4m3 KV write: bytes equal torch's quantize_rows", same, target="True" if ctx.cuda else None,
             met=same if ctx.cuda else None, how="kernels.kv_fp8_kernel.write_kv_fp8 vs orca_mq.engine.fp8.quantize_rows "
             "(the interpreter's e4m3 cast drops carries: only a GPU's bytes can match)")
    splits = max(2, choose_splits(rows, KV_HEADS, c["tables"].shape[1] * BLOCK, sms))
    args = (c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], HEAD_DIM ** -0.5, splits)
    ms = kernel_ms(ctx, lambda: split_kv_decode(*args[:1], *caches, *args[3:], k_scale=scales[0], v_scale=scales[1]))
    err = rel_err(split_kv_decode(*args[:1], *caches, *args[3:], k_scale=scales[0], v_scale=scales[1]), split_kv_decode(*args))
    kv_bytes = 2 * rows * context * KV_HEADS * (HEAD_DIM + 4)
    frac = kv_bytes / (ms / 1e3) / bw
    ctx.emit(f"decode attention, e4m3 KV, b={rows} ctx={context}: ms (KV read / copy bandwidth)", frac, unit="x",
             shown=f"{ms:.3f} ms ({frac:.0%}), rel err vs bf16 KV {err:.2g}", split_ms=ms, rel_err_vs_bf16=err,
             how="split_kv_decode with k_scale / v_scale: e4m3 values + a float32 scale per token and KV head")


def prefill(ctx: Ctx, n: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    """One prompt of n tokens at head_dim 128: the ragged kernel vs SDPA (causal, the same keys contiguous)."""
    import torch.nn.functional as F

    from kernels.attention_kernel import ragged_paged_attention

    c = paged(ctx, 1, n, dtype, gen)
    q = torch.randn(n, HEADS, HEAD_DIM, device=ctx.device).to(dtype)
    cu = torch.tensor([0, n], dtype=torch.int32, device=ctx.device)
    scale = HEAD_DIM ** -0.5
    ragged = kernel_ms(ctx, lambda: ragged_paged_attention(q, c["k_cache"], c["v_cache"], c["tables"], cu, c["seq_lens"], scale))
    rows = c["tables"][0].long()
    k = c["k_cache"][rows].reshape(-1, KV_HEADS, HEAD_DIM)[:n].transpose(0, 1)[None]
    v = c["v_cache"][rows].reshape(-1, KV_HEADS, HEAD_DIM)[:n].transpose(0, 1)[None]
    qs = q.transpose(0, 1)[None]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)

    ref = kernel_ms(ctx, sdpa)
    err = rel_err(ragged_paged_attention(q, c["k_cache"], c["v_cache"], c["tables"], cu, c["seq_lens"], scale),
                  sdpa()[0].transpose(0, 1))
    flops = 2 * n * n * HEADS * HEAD_DIM   # causal: half of 4 n^2 H d
    ctx.emit(f"prefill attention, one {n}-token prompt, head_dim 128: ragged TFLOP/s (SDPA's)", flops / ragged / 1e9,
             unit="TFLOP/s", shown=f"{flops / ragged / 1e9:.0f} ({flops / ref / 1e9:.0f}), {ragged:.3f} / {ref:.3f} ms, "
                                   f"rel err {err:.1g}", ragged_ms=ragged, sdpa_ms=ref, rel_err_vs_sdpa=err,
             how="kernels.attention_kernel.ragged_paged_attention vs F.scaled_dot_product_attention(is_causal, enable_gqa)")


def tune(ctx: Ctx) -> None:
    """The split kernel's launch shapes at the longest context: splits (the chosen count x 1, 2, 4),
    keys per step, warps and pipelined stages; per batch the best few (KV read / copy bandwidth) and
    the default's, every timing in the row's JSON."""
    if not ctx.cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    from kernels.split_kv_kernel import TILES, Tiles, choose_splits, sm_count, split_kv_decode

    torch.manual_seed(43)
    bw = copy_bandwidth(ctx)
    context = CONTEXTS[-1] if ctx.cuda else SMALL_CONTEXTS[-1]
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator().manual_seed(43)
    shapes = [Tiles(n, w, st) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)] if ctx.cuda else \
        [Tiles(n, 4, 0) for n in (32, 64)]
    for rows in BATCHES if ctx.cuda else SMALL_BATCHES:
        with ctx.attempt(f"tune b={rows}"):
            c = paged(ctx, rows, context, dtype, gen)
            args = (c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], HEAD_DIM ** -0.5)
            chosen = max(2, choose_splits(rows, KV_HEADS, c["tables"].shape[1] * BLOCK, sm_count(torch.device(ctx.device))))
            ref = split_kv_decode(*args, chosen)
            kv_bytes = 2 * rows * context * KV_HEADS * HEAD_DIM * c["k_cache"].element_size()
            runs = []
            for splits in (chosen, 2 * chosen, 4 * chosen):
                for t in [TILES] + shapes:
                    try:
                        err = rel_err(split_kv_decode(*args, splits, tiles=t), ref)
                        ms = kernel_ms(ctx, lambda t=t, n=splits: split_kv_decode(*args, n, tiles=t))
                    except Exception as e:   # noqa: BLE001 - a shape the card cannot take (registers, shared memory)
                        runs.append({"splits": splits, "tiles": str(t), "error": str(e)[:100]})
                        continue
                    runs.append({"splits": splits, "tiles": str(t), "ms": ms, "frac": kv_bytes / (ms / 1e3) / bw, "err": err})
            ok = sorted((r for r in runs if "ms" in r), key=lambda r: r["ms"])
            default = next(r for r in runs if r["splits"] == chosen and r["tiles"] == str(TILES))
            best = ok[0]
            ctx.emit(f"split-KV launch shapes, b={rows} ctx={context}: best / default (KV read / copy bandwidth)",
                     best["frac"], unit="x", target=f">= {TARGET:.0%}" if ctx.cuda else None,
                     met=best["frac"] >= TARGET if ctx.cuda else None,
                     shown=f"{best['frac']:.0%} ({best['ms']:.3f} ms, {best['splits']} splits, {best['tiles']}) / "
                           f"{default['frac']:.0%}", runs=runs,
                     top=[f"{r['frac']:.0%} {r['ms']:.3f} ms {r['splits']} {r['tiles']}" for r in ok[:6]],
                     how="kernels.split_kv_kernel.split_kv_decode(tiles=...), do_bench medians; err vs the default's output")
            del c


def splitkv(ctx: Ctx) -> None:
    """The engine's decode iteration (the random model as served: CUDA graphs, bf16) with
    engine.split_kv auto against off: what splitting costs at a short context and gives at a long one."""
    from orca_mq.bench.plans import plan_for
    from orca_mq.protocol.iteration import pack

    if not ctx.cuda:   # the Triton backend under the interpreter (before triton is first imported)
        os.environ["TRITON_INTERPRET"] = "1"
    batches, contexts = ((1, 4, 16, 32), (256, 2000)) if ctx.cuda else ((1, 2), (24, 100))
    slots = max(batches) * (max(contexts) + 2 * BLOCK)
    runners = {mode: ctx.runner("smol", ctx.fast_dtype, engine__split_kv=mode, engine__n_slots=slots,
                                scheduler__max_bs=max(batches), engine__attention_backend="triton")
               for mode in ("auto", "off")}
    for b in batches:
        for context in contexts:
            with ctx.attempt(f"engine decode b={b} ctx={context}"):
                plan = pack(plan_for([(1, context - 1)] * b, BLOCK))
                auto, off = (ctx.timed_ms(lambda r=r: r.execute(plan)) for r in runners.values())
                ctx.emit(f"engine decode iteration b={b} ctx={context}: split_kv auto / off", auto / off, unit="x",
                         shown=f"{auto / off:.2f}x ({auto:.3f} / {off:.3f} ms)", auto_ms=auto, off_ms=off,
                         how="ModelRunner.execute (smol, graphs as served), median, synchronized")
