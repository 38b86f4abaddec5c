"""tools/gpu_check.py --shape NAME (issue 42, item 2): a published model's shape (orca_mq/bench/shapes.py)
with random weights drawn on the device at load, measured against what the card allows, one call per shape.

- shape_iteration: the card's copy bandwidth and GEMM rate, measured first; the engine's decode iteration
  at batch 1 and 64 over 2k tokens of context beside its bandwidth floor (the weights it reads, a MoE's
  expected share of its experts, and the KV, over the copy bandwidth) and beside a CUDA-graph probe of
  the same step over the same weights; prompt iterations beside their FLOP floor (every GEMM's and the
  causal attention's FLOPs over the measured rate; FP8 weights at the FP8 rate).
- shape_burst: 1,000 requests with prompts and outputs uniform in 128-512 tokens, served through a
  launched server, then the same requests offline (gen tok/s).
Issue 42's targets (8B shapes at their published depth): decode b=1 <= 1.15x its floor, b=64 at 2k <=
1.3x; offline >= 16k gen tok/s, with FP8 weights >= 1.5x that.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from orca_mq.bench.gpu_attention import copy_bandwidth, kernel_ms
from orca_mq.bench.gpu_context import Ctx
from orca_mq.bench.shapes import ShapeRun

BLOCK = 16
EIGHT_B = ("llama-3.1-8b", "qwen3-8b")
DECODE_TARGETS = {1: 1.15, 64: 1.3}     # engine / bandwidth floor, by batch
OFFLINE_TARGET = 16_000                  # gen tok/s, bf16 (1.5x with FP8 weights)


@dataclass(frozen=True, slots=True)
class ShapeSizes:
    batches: tuple[int, ...] = (1, 64)
    ctx: int = 2048                      # each decode row's context, and each prompt's length
    prompts: tuple[int, ...] = (1, 4)    # prompts of `ctx` tokens in one prefill iteration
    repeat: int = 10
    gemm_n: int = 8192                   # the card's GEMM rate: an n x n x n product
    burst: int = 1000
    warm: int = 100                      # the served warm-up burst
    lengths: tuple[int, int] = (128, 512)   # prompts and outputs alike, uniform
    max_bs: int = 256
    budget: int = 8192
    slots: int = 0                       # the bursts' KV pool: 0 = sized from the card


SMALL = ShapeSizes(batches=(1, 4), ctx=48, prompts=(1, 2), repeat=2, gemm_n=256, burst=12, warm=0, lengths=(8, 24),
                   max_bs=8, budget=128, slots=4096)


def _setup(ctx: Ctx) -> tuple[ShapeRun, ShapeSizes, str]:
    """The run's shape, its sizes and its checkpoint's name under ctx.models (written there once)."""
    if ctx.shape is None:
        raise RuntimeError("the shape sections need --shape NAME")
    return ctx.shape, SMALL if ctx.small else ShapeSizes(), ctx.shape.directory(ctx.models, ctx.small).name


def _targeted(run: ShapeRun, ctx: Ctx) -> bool:
    """Issue 42's targets are an 8B model's, measured on a GPU, at its published depth."""
    return ctx.cuda and run.name in EIGHT_B and run.layers is None


def shape_iteration(ctx: Ctx) -> None:
    from orca_mq.bench.graph_probe import ProbeModel, pool_caches, probe
    from orca_mq.bench.plans import plan_for
    from orca_mq.protocol.iteration import pack

    run, sz, name = _setup(ctx)
    bw = copy_bandwidth(ctx)
    ctx.emit("copy bandwidth (device to device, read + written)", bw / 1e9, unit="GB/s",
             how="torch copy_ of 1 GiB (the decode section's probe), do_bench median")
    rates = gemm_rates(ctx, sz.gemm_n, run.fp8)
    for kind, rate in rates.items():
        ctx.emit(f"{kind} GEMM rate ({sz.gemm_n}^3)", rate / 1e12, unit="TFLOP/s",
                 how="torch.mm" if kind == "dense" else "engine/fp8.py linear (per-token scaling + torch._scaled_mm)")
    slots = max(max(sz.batches), max(sz.prompts)) * (sz.ctx + BLOCK) + BLOCK
    r = ctx.runner(name, ctx.fast_dtype, engine__n_slots=slots, scheduler__max_bs=max(sz.batches), model__max_model_len=sz.ctx,
                   scheduler__max_num_batched_tokens=max(sz.prompts) * sz.ctx, model__quantization="fp8" if run.fp8 else None)
    params, size = sum(_numel(t) for t in _tensors(r)), sum(_bytes(t) for t in _tensors(r))
    ctx.emit(f"{run.name}: {r.info.n_layers} layers, random weights made on {ctx.device}", params / 1e9, unit="B params",
             shown=f"{params / 1e9:.3g} B parameters, {size / 1e9:.3g} GB ({ctx.fast_dtype}{', fp8 GEMMs' if run.fp8 else ''}); "
                   f"CUDA graphs {len(r.graphs.graphs) if r.graphs else 0}", weight_bytes=size,
             how="orca_mq/models/random_weights.py through ModelRunner", info=str(r.info))
    yard = ProbeModel(r.info, r.model.w, r.model.mlps)
    targeted = _targeted(run, ctx) and not run.fp8
    how = f"ModelRunner.execute of a packed plan (inputs staged, forward, sampling, tokens back), median of {sz.repeat}"
    for b in sz.batches:
        with ctx.attempt(f"decode b={b}"):
            ms = ctx.timed_ms(lambda p=pack(plan_for([(1, sz.ctx - 1)] * b, BLOCK)): r.execute(p), sz.repeat)
            weights, kv = read_bytes(r, b), b * sz.ctx * r.kv.block_bytes() // BLOCK
            floor = (weights + kv) / bw * 1e3
            limit = DECODE_TARGETS.get(b) if targeted else None
            ctx.emit(f"decode b={b} ctx={sz.ctx}: engine / bandwidth floor", ms / floor, unit="x",
                     target=f"<= {limit}x" if limit else None, met=ms / floor <= limit if limit else None,
                     shown=f"{ms / floor:.2f}x ({ms:.3g} ms, floor {floor:.3g}: {weights / 1e9:.3g} GB + "
                           f"{kv / 1e9:.3g} GB KV)", engine_ms=ms, floor_ms=floor, weight_bytes=weights, kv_bytes=kv,
                     how=how + "; floor: the weights it reads (a MoE: each expert's chance of a row) + KV, "
                               "over the copy bandwidth")
            p = probe(yard, b, sz.ctx, pool_caches(r.kv, b, sz.ctx), repeat=2 * sz.repeat)
            base = p.get("graph_ms", p["eager_ms"])
            ctx.emit(f"decode b={b} ctx={sz.ctx}: engine / CUDA-graph probe", ms / base, unit="x",
                     shown=f"{ms / base:.2f}x (probe {'graph' if 'graph_ms' in p else 'eager'} {base:.3g} ms)",
                     probe=p, how="orca_mq.bench.graph_probe over the runner's weights and pool")
    for n in sz.prompts:
        with ctx.attempt(f"prefill {n}x{sz.ctx}"):
            ms = ctx.timed_ms(lambda p=pack(plan_for([(sz.ctx, 0)] * n, BLOCK)): r.execute(p), sz.repeat)
            flops, floor_s = prefill_floor(r, n, sz.ctx, rates)
            ctx.emit(f"prefill {n} prompt(s) of {sz.ctx}: engine / FLOP floor", ms / (floor_s * 1e3), unit="x",
                     shown=f"{ms / (floor_s * 1e3):.2f}x ({ms:.3g} ms, floor {floor_s * 1e3:.3g}: {flops / 1e12:.3g} "
                           f"TFLOP, {flops / (ms / 1e3) / 1e12:.3g} TFLOP/s)",
                     engine_ms=ms, floor_ms=floor_s * 1e3, flops=flops, how=how)


def shape_burst(ctx: Ctx) -> None:
    from orca_mq.bench.gpu_speed import Burst, served_and_offline

    run, sz, name = _setup(ctx)
    target = OFFLINE_TARGET * (1.5 if run.fp8 else 1) if _targeted(run, ctx) else None
    served_and_offline(ctx, name, Burst(sz.burst, sz.warm, sz.lengths, sz.lengths, sz.max_bs, sz.budget, sz.slots,
                                        {"model.quantization": "fp8"} if run.fp8 else {}, offline_target=target))


def gemm_rates(ctx: Ctx, n: int, fp8: bool) -> dict[str, float]:
    """FLOP/s of an n x n x n product in the compute dtype ("dense") and, with FP8 weights, the engine's FP8 one."""
    from orca_mq.engine import fp8 as f8

    dtype = getattr(torch, ctx.fast_dtype)
    a, w = (torch.randn(n, n, device=ctx.device).to(dtype) for _ in range(2))
    rates = {"dense": 2 * n**3 / (kernel_ms(ctx, lambda: torch.mm(a, w)) / 1e3)}
    if fp8:
        q = f8.quantize_weight(w)
        rates["fp8"] = 2 * n**3 / (kernel_ms(ctx, lambda: f8.linear(a, q)) / 1e3)   # type: ignore[arg-type]
    return rates


def _tensors(r: Any) -> list[Any]:
    """The runner's weights, a tied head once."""
    w = r.model.w
    seen = {id(t): t for t in [*(t for layer in w.layers for t in layer.values()), *(w.final_norm or {}).values(),
                               w.embed, w.lm_head] if t is not None}
    return list(seen.values())


def _numel(t: Any) -> int:
    return int(t.numel())


def _bytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _expert_share(r: Any, rows: int) -> float:
    """The expected share of a layer's experts that `rows` tokens route to (each its top-k of E, uniformly)."""
    moe = r.info.moe
    return 1.0 if moe is None else 1 - (1 - moe.top_k / moe.n_experts) ** rows


def read_bytes(r: Any, batch: int) -> int:
    """Weight bytes a decode iteration of `batch` rows reads: the layers (experts by their expected
    share), the final norm and the LM head; the embedding only its rows (left out)."""
    from orca_mq.models.weights import EXPERTS

    w, share = r.model.w, _expert_share(r, batch)
    layers = sum(_bytes(t) * (share if k in EXPERTS else 1) for layer in w.layers for k, t in layer.items())
    return int(layers) + sum(_bytes(t) for t in (w.final_norm or {}).values()) + _bytes(w.lm_head)


def prefill_floor(r: Any, prompts: int, length: int, rates: dict[str, float]) -> tuple[float, float]:
    """(FLOPs, seconds at the measured rates) of `prompts` prompts of `length` tokens: every matrix of
    every layer over every token (an expert over its top-k share), causal attention, the LM head once
    a prompt. FP8 weights at the FP8 rate, the rest at the dense one."""
    from orca_mq.engine.fp8 import Fp8Weight
    from orca_mq.models.weights import EXPERTS

    info, w, tokens = r.info, r.model.w, prompts * length
    share = info.moe.top_k / info.moe.n_experts if info.moe else 1.0
    flops = seconds = 0.0
    for layer in w.layers:
        for k, t in layer.items():
            if len(t.shape) >= 2:
                f = 2 * tokens * _numel(t) * (share if k in EXPERTS else 1)
                flops, seconds = flops + f, seconds + f / rates["fp8" if isinstance(t, Fp8Weight) else "dense"]
    rest = 2 * prompts * length**2 * info.n_heads * info.head_dim * len(w.layers) + 2 * prompts * _numel(w.lm_head)
    return flops + rest, seconds + rest / rates["dense"]
