"""Triton kernel: the iteration's new K/V into a paged KV cache in e4m3, a scale per token and KV head.

The arithmetic is orca_mq/engine/fp8.py's `quantize_rows` over each head's row (max|x| / 448,
x / scale rounded to nearest even after a clamp to +-448), so the cache's bytes equal the torch
reference's; kernels/split_kv_kernel.py reads them back (scores x K scale, probabilities x V scale).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["write_kv_fp8"]

E4M3_MAX = tl.constexpr(448.0)           # orca_mq/engine/fp8.py's E4M3_MAX and MIN_SCALE
MIN_SCALE = tl.constexpr(2.0 ** -126)


@triton.jit
def _quantize_store(x, cache_ptr, scale_ptr, mask, h_mask):
    """Rows of x [BLOCK_H, BLOCK_D] (fp32) in e4m3 at cache_ptr, their scales at scale_ptr."""
    scale = tl.maximum(tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1) / E4M3_MAX, MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -E4M3_MAX), E4M3_MAX)
    tl.store(cache_ptr, q.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(scale_ptr, scale, mask=h_mask)


@triton.jit
def _write_kv_fp8_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
    block_size, n_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding token: nothing to write
        return
    blk, off = slot // block_size, slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < n_kv_heads
    mask = h_mask[:, None] & (offs_d[None, :] < head_dim)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask).to(tl.float32)
    cache = blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    scales = blk * stride_sb + off * stride_ss + offs_h * stride_sh
    _quantize_store(k, k_cache_ptr + cache, k_scale_ptr + scales, mask, h_mask)
    _quantize_store(v, v_cache_ptr + cache, v_scale_ptr + scales, mask, h_mask)


def write_kv_fp8(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Tensor, v_scale: Tensor,
                 slot_mapping: Tensor) -> None:
    """``k, v [T, n_kv_heads, d]`` (any float dtype, strided views allowed) into ``k_cache, v_cache
    [num_blocks, block_size, n_kv_heads, d]`` (float8_e4m3fn) and ``k_scale, v_scale [num_blocks,
    block_size, n_kv_heads]`` (float32) in place; tokens whose ``slot_mapping`` is negative are skipped.
    One program per token; nothing is read back to the host (a CUDA graph may capture it)."""
    T = k.shape[0]
    _, block_size, n_kv_heads, d = k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k.shape == (T, n_kv_heads, d) == v.shape and slot_mapping.shape == (T,)
    assert k_scale.shape == k_cache.shape[:3] == v_scale.shape and v_scale.stride() == k_scale.stride()
    if T == 0:
        return
    _write_kv_fp8_kernel[(T,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping.contiguous(),
        *k.stride(), *v.stride(), *k_cache.stride(), *k_scale.stride(),
        block_size, n_kv_heads, d,
        BLOCK_H=triton.next_power_of_2(n_kv_heads), BLOCK_D=triton.next_power_of_2(d),
    )
