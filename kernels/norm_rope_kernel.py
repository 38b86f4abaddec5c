"""Triton kernels: RMSNorm (optionally fused with the residual add) and rotary embedding.

Both run once over the iteration's flattened ``[T, ...]`` tokens (no notion of
request), one program per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["rms_norm", "fused_add_rms_norm", "rotary"]


# ---------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # the residual stream is kept in the model dtype (as in HF): round the sum
        summed = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    var = tl.sum(x * x, axis=0) / hidden
    # HF LlamaRMSNorm rounding: normalise in fp32, round to the input dtype, then * weight
    normed = (x * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: Tensor) -> Tensor:
    assert x.dim() == 2, "expected [T, hidden]"
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama RMSNorm of ``x [T, hidden]`` (fp32 math); returns a new tensor of ``x.dtype``."""
    x = _rows(x)
    T, hidden = x.shape
    assert weight.shape == (hidden,)
    weight = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    _rms_norm_kernel[(T,)](
        x, x, weight, out, out,
        x.stride(0), x.stride(0), out.stride(0), out.stride(0),
        hidden, float(eps),
        HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(hidden),
    )
    return out


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``new_residual = x + residual``; ``normed = rms_norm(new_residual)``. One launch.

    Returns new tensors ``(normed, new_residual)`` (both ``x.dtype``); inputs untouched.
    """
    x, residual = _rows(x), _rows(residual)
    T, hidden = x.shape
    assert residual.shape == x.shape and weight.shape == (hidden,)
    weight = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_res = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return out, new_res
    _rms_norm_kernel[(T,)](
        x, residual, weight, out, new_res,
        x.stride(0), residual.stride(0), out.stride(0), new_res.stride(0),
        hidden, float(eps),
        HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(hidden),
    )
    return out, new_res


# ---------------------------------------------------------------------------
# Rotary embedding (HF rotate_half layout)
# ---------------------------------------------------------------------------


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, half, BLOCK_HALF: tl.constexpr):
    """Both halves of position ``pos``'s cos and sin rows, in fp32."""
    offs_d = tl.arange(0, BLOCK_HALF)
    dm = offs_d < half
    c = cos_ptr + pos * stride_cos + offs_d
    s = sin_ptr + pos * stride_sin + offs_d
    cos1 = tl.load(c, mask=dm, other=0.0).to(tl.float32)
    cos2 = tl.load(c + half, mask=dm, other=0.0).to(tl.float32)
    sin1 = tl.load(s, mask=dm, other=0.0).to(tl.float32)
    sin2 = tl.load(s + half, mask=dm, other=0.0).to(tl.float32)
    return cos1, cos2, sin1, sin2


@triton.jit
def _half_heads(stride_h, n_h, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Offsets of the first half of every head ``[BLOCK_H, BLOCK_HALF]`` (the second is ``+ half``) and their mask."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    return offs_h[:, None] * stride_h + offs_d[None, :], (offs_h[:, None] < n_h) & (offs_d[None, :] < half)


@triton.jit
def _rope(x_ptr, p, mask, half, cos1, cos2, sin1, sin2):
    """The rotated halves ``(o1, o2)`` (fp32) of the heads at ``x_ptr + p``: ``out = x*cos + rotate_half(x)*sin``,
    ``rotate_half(x) = cat(-x2, x1)``. Every rotary kernel goes through here, so they round alike."""
    x1 = tl.load(x_ptr + p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + p + half, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos1[None, :] - x2 * sin1[None, :], x2 * cos2[None, :] + x1 * sin2[None, :]


@triton.jit
def _rope_rows(
    x_ptr, o_ptr, stride_h, stride_oh, n_h, half,
    cos1, cos2, sin1, sin2,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    p, mask = _half_heads(stride_h, n_h, half, BLOCK_H, BLOCK_HALF)
    po, _ = _half_heads(stride_oh, n_h, half, BLOCK_H, BLOCK_HALF)
    o1, o2 = _rope(x_ptr, p, mask, half, cos1, cos2, sin1, sin2)
    tl.store(o_ptr + po, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + po + half, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cos, stride_sin,
    n_heads, n_kv_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos1, cos2, sin1, sin2 = _rope_tables(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, half, BLOCK_HALF)
    _rope_rows(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh, n_heads, half,
               cos1, cos2, sin1, sin2, BLOCK_HQ, BLOCK_HALF)
    _rope_rows(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, stride_kh, stride_koh, n_kv_heads, half,
               cos1, cos2, sin1, sin2, BLOCK_HK, BLOCK_HALF)


def rotary(q: Tensor, k: Tensor, positions: Tensor, cos_cache: Tensor, sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary embedding of ``q [T, H, d]`` and ``k [T, kvh, d]`` in one launch. OUT OF PLACE.

    ``positions [T]`` int; ``cos_cache/sin_cache [max_pos, d]`` in HF
    rotate_half layout. Returns new contiguous ``(q_rot, k_rot)`` in the input
    dtypes (fp32 math); ``q`` and ``k`` are not modified.
    """
    T, n_heads, d = q.shape
    assert k.shape[0] == T and k.shape[2] == d and d % 2 == 0
    assert cos_cache.shape[-1] == d and sin_cache.shape[-1] == d
    n_kv_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos_cache.stride(-1) != 1:
        cos_cache = cos_cache.contiguous()
    if sin_cache.stride(-1) != 1:
        sin_cache = sin_cache.contiguous()
    positions = positions.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    half = d // 2
    _rotary_kernel[(T,)](
        q, k, q_out, k_out, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_cache.stride(0), sin_cache.stride(0),
        n_heads, n_kv_heads, half,
        BLOCK_HQ=triton.next_power_of_2(n_heads),
        BLOCK_HK=triton.next_power_of_2(n_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out, k_out
