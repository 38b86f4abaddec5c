"""tools/gpu_check.py's moe section: the fused MoE kernel (kernels/fused_moe_kernel.py) at Qwen3-30B-A3B's
expert shape, bf16 with random weights made on the device, beside the dense GEMMs of the same active
parameters (a token's top_k experts as one MLP top_k x as wide), both timed in CUDA graphs as the engine
replays them, and the grouped path (models/layers/moe.py: torch's grouped_mm, eager: its offsets are read
on the host); and the kernel's results against the grouped path's. On the CPU it is skipped:
tests/test_moe.py runs the kernel under TRITON_INTERPRET=1 there."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from orca_mq.bench.gpu_context import Ctx

# Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, each expert's intermediate 768
QWEN3_30B_A3B = (2048, 128, 8, 768)
BATCHES = (1, 32, 256)
FP32_TOL = 1e-4   # sums of 2048 float32 products in another order, against the largest output
Timer = Callable[[Callable[[], object]], float]   # ms of a call


def moe(ctx: Ctx) -> None:
    if not ctx.cuda:
        ctx.emit("fused MoE kernel: skipped (no CUDA)", shown="tests/test_moe.py runs it under TRITON_INTERPRET=1")
        return
    import triton.testing

    torch.backends.cuda.matmul.allow_tf32 = False
    measure(ctx, "cuda", QWEN3_30B_A3B, BATCHES,
            graph=lambda fn: triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"),
            eager=lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def measure(ctx: Ctx, device: str, dims: tuple[int, int, int, int], batches: tuple[int, ...], graph: Timer,
            eager: Timer) -> None:
    """Each batch's rows: times (fused and dense by `graph`, grouped and fused by `eager`) and errors."""
    from kernels import silu_mul
    from kernels.fused_moe_kernel import fused_moe
    from orca_mq.models.layers.moe import grouped

    hidden, experts, top_k, inter = dims
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    gate_up = randn(experts, 2 * inter, hidden, scale=hidden ** -0.5)
    down = randn(experts, hidden, inter, scale=inter ** -0.5)
    dense_gu = randn(2 * top_k * inter, hidden, scale=hidden ** -0.5)
    dense_down = randn(hidden, top_k * inter, scale=inter ** -0.5)
    gate_up32, down32 = gate_up.float(), down.float()
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * 2
    shape = f"hidden {hidden}, {experts} experts, top-{top_k}, expert intermediate {inter}, bf16"
    for t in batches:
        x = randn(t, hidden)
        top, ids = torch.topk(torch.softmax(torch.randn(t, experts, generator=g, device=device), -1), top_k, -1)
        weights = (top / top.sum(-1, keepdim=True)).to(torch.bfloat16)
        with ctx.attempt(f"T={t} timing"):
            fused = graph(lambda: fused_moe(x, gate_up, down, ids, weights, silu_mul))
            dense = graph(lambda: F.linear(silu_mul(F.linear(x, dense_gu)), dense_down))
            active = int(ids.unique().numel())
            gb_s = active * expert_bytes / fused / 1e6
            ctx.emit(f"MoE layer T={t}: fused kernel / dense GEMMs of equal active params", fused / dense, unit="x",
                     shown=f"{fused / dense:.2f}x (fused {fused:.3f} ms, dense {dense:.3f} ms; {active} experts' "
                           f"weights at {gb_s:.0f} GB/s)",
                     how=f"CUDA-graph replays (triton.testing.do_bench_cudagraph median); {shape}; random routing",
                     fused_ms=fused, dense_ms=dense, experts_read=active, fused_gb_s=gb_s)
        with ctx.attempt(f"T={t} grouped path timing"):
            grouped_ms = eager(lambda: grouped(x, gate_up, down, ids, weights, silu_mul))
            fused_eager = eager(lambda: fused_moe(x, gate_up, down, ids, weights, silu_mul))
            ratio = grouped_ms / fused_eager
            ctx.emit(f"MoE layer T={t}, eager: grouped path (torch grouped_mm) / fused kernel", ratio, unit="x",
                     shown=f"{ratio:.2f}x ({grouped_ms:.3f} / {fused_eager:.3f} ms)",
                     how="triton.testing.do_bench median; the grouped path reads its offsets on the host (no graph)",
                     grouped_ms=grouped_ms, fused_eager_ms=fused_eager)
        with ctx.attempt(f"T={t} exactness"):
            ref = grouped(x.float(), gate_up32, down32, ids, weights.float(), silu_mul)
            scale = ref.abs().max().item()
            f32 = (fused_moe(x.float(), gate_up32, down32, ids, weights.float(), silu_mul) - ref).abs().max().item()
            f32 /= scale
            ours = (fused_moe(x, gate_up, down, ids, weights, silu_mul).float() - ref).abs().max().item()
            theirs = (grouped(x, gate_up, down, ids, weights, silu_mul).float() - ref).abs().max().item()
            ctx.emit(f"MoE layer T={t}: fused vs grouped, float32: max rel err", f32, target=f"<= {FP32_TOL:g}",
                     met=f32 <= FP32_TOL, how="the same weights in float32 (no TF32); grouped: models/layers/moe.py")
            ctx.emit(f"MoE layer T={t}: bf16 max abs err vs float32 grouped", ours,
                     target=f"<= 1.5x grouped bf16 ({theirs:.3g})", met=ours <= 1.5 * theirs,
                     how="fused bf16 and grouped bf16 (torch grouped_mm), each against the float32 grouped path")
