"""Triton kernels: a mixture of experts in two grouped-GEMM launches (the design of vLLM's fused_moe).

The (token, slot) pairs are sorted by expert and each expert's run padded to a whole number of BLOCK_M
tiles (`align`, vLLM's moe_align_block_size done with torch ops); one launch multiplies every tile by
its expert's gate_up (a program: one tile of rows x BLOCK_N of its outputs), the activation runs on the
[T*k, 2I] result, a second launch multiplies by down with the routing weight folded in, and each
token's k rows are summed. Nothing reads a device value on the host and every size is a static bound
of T*k, so a CUDA graph can capture it. Float32 multiplies in IEEE float32 (no TF32), 16-bit types in
their own with float32 accumulation.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["align", "fused_moe"]


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, bias_ptr, route_ptr, out_ptr, pairs_ptr, block_expert_ptr, used_ptr,
                         n_pairs, n_rows, N, K, stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_om,
                         A_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out[pair] = a[pair // A_DIV] @ w[expert].T (+ bias[expert]) (* route[pair]) for one tile of pairs."""
    pid = tl.program_id(0)
    # GROUP_M tiles of rows share each column block in turn: their expert's weights stay in L2
    n_m, n_n = tl.cdiv(n_rows, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first = pid // (GROUP_M * n_n) * GROUP_M
    group = tl.minimum(n_m - first, GROUP_M)
    pid_m = first + (pid % (GROUP_M * n_n)) % group
    pid_n = (pid % (GROUP_M * n_n)) // group
    if pid_m * BLOCK_M >= tl.load(used_ptr):   # a tile past the padded runs in use
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < n_pairs                    # n_pairs marks a padding row
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=in_k[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if ROUTE:
        acc *= tl.load(route_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def align(ids: Tensor, n_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """(pairs [R] int32: the pair indices t*k + j sorted by expert, each expert's run padded to a multiple
    of block_m with T*k; the expert of each block_m rows [R / block_m]; the rows in use [1]). R is a
    static bound: at most min(E, T*k) experts have pairs, each padding fewer than block_m rows."""
    flat = ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    # scatter_add_, not bincount: bincount reads the largest id on the host
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat.index_select(0, order)
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts).index_select(0, expert)
    dest = (padded_end - padded).index_select(0, expert) + rank
    rows = triton.cdiv(n + min(n_experts, n) * (block_m - 1), block_m) * block_m
    pairs = torch.full((rows,), n, dtype=torch.int32, device=dev).scatter_(0, dest, order.int())
    starts = torch.arange(0, rows, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, starts, right=True).int()   # E past the runs: never read
    return pairs, block_expert, padded_end[-1:]


def _config(pairs: int, n_experts: int, dtype: torch.dtype) -> dict[str, int]:
    """Tiles: up to 16 rows per expert on average (decode) take thin, deep tiles, that a run pads little;
    more take square ones (the shapes of vLLM's defaults). Float32 tiles are twice the bytes: one
    pipeline stage fewer."""
    stages = 2 if dtype == torch.float32 else 3
    if pairs <= 16 * n_experts:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=stages)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=stages)


def _grouped_gemm(a: Tensor, w: Tensor, bias: Tensor | None, route: Tensor | None, a_div: int, pairs: Tensor,
                  block_expert: Tensor, used: Tensor, n_pairs: int, cfg: dict[str, int]) -> Tensor:
    """[n_pairs, N]: each pair's row of `a` (row pair // a_div) times its expert's w [E, N, K]."""
    if a.stride(-1) != 1:
        a = a.contiguous()
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(n_pairs, n, dtype=a.dtype, device=a.device)
    grid = (pairs.numel() // cfg["BLOCK_M"] * triton.cdiv(n, cfg["BLOCK_N"]),)
    _grouped_gemm_kernel[grid](
        a, w, bias if bias is not None else w, route if route is not None else w, out, pairs, block_expert, used,
        n_pairs, pairs.numel(), n, k, a.stride(0), w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        A_DIV=a_div, HAS_BIAS=bias is not None, ROUTE=route is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **cfg)
    return out


def fused_moe(x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, act: Callable[[Tensor], Tensor],
              gate_up_b: Tensor | None = None, down_b: Tensor | None = None) -> Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], ids / weights [T, k] -> [T, H]: each token's experts
    weighted and summed, as models/layers/moe.py's grouped path computes them."""
    t, k = ids.shape
    if t == 0:
        return torch.zeros_like(x)
    cfg = _config(t * k, gate_up.shape[0], x.dtype)
    pairs, block_expert, used = align(ids, gate_up.shape[0], cfg["BLOCK_M"])
    route = weights.reshape(-1).contiguous()
    h = act(_grouped_gemm(x, gate_up, gate_up_b, None, k, pairs, block_expert, used, t * k, cfg))
    out = _grouped_gemm(h, down, down_b, route, 1, pairs, block_expert, used, t * k, cfg)
    return out.view(t, k, -1).sum(1)
