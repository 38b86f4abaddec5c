"""Triton kernel: rotary embedding fused with the KV write, for the Llama layer's fused QKV output.

One launch replaces ``rotary`` then ``write_kv`` (kernels/norm_rope_kernel.py, kv_write_kernel.py): one
program per token rotates its Q and K heads in place and writes its rotated K and its V into the
paged cache. It uses the same fp32 arithmetic (``_rope``) and the same roundings (to the QKV dtype,
then to the cache's), so its results are bit-identical to the two kernels'.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .norm_rope_kernel import _half_heads, _rope, _rope_rows, _rope_tables

__all__ = ["rotary_write_kv"]


@triton.jit
def _rotary_write_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_t, stride_cos, stride_sin,
    stride_cb, stride_cs, stride_ch,
    n_heads, n_kv_heads, half, block_size,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos1, cos2, sin1, sin2 = _rope_tables(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, half, BLOCK_HALF)
    q_row = qkv_ptr + t * stride_t
    d = 2 * half
    _rope_rows(q_row, q_row, d, d, n_heads, half, cos1, cos2, sin1, sin2, BLOCK_HQ, BLOCK_HALF)

    k_row = q_row + n_heads * d
    p, mask = _half_heads(d, n_kv_heads, half, BLOCK_HK, BLOCK_HALF)
    k1, k2 = _rope(k_row, p, mask, half, cos1, cos2, sin1, sin2)
    k1 = k1.to(qkv_ptr.dtype.element_ty)  # what `rotary` returns, which `write_kv` then casts to the cache
    k2 = k2.to(qkv_ptr.dtype.element_ty)
    tl.store(k_row + p, k1, mask=mask)
    tl.store(k_row + p + half, k2, mask=mask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative: a padding token, nothing to write
        pc, _ = _half_heads(stride_ch, n_kv_heads, half, BLOCK_HK, BLOCK_HALF)
        pc += (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
        tl.store(k_cache_ptr + pc, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(k_cache_ptr + pc + half, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v_row = k_row + n_kv_heads * d
        v1 = tl.load(v_row + p, mask=mask)
        v2 = tl.load(v_row + p + half, mask=mask)
        tl.store(v_cache_ptr + pc, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + pc + half, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_write_kv(
    qkv: Tensor, positions: Tensor, cos_cache: Tensor, sin_cache: Tensor, slot_mapping: Tensor,
    k_cache: Tensor, v_cache: Tensor, n_heads: int, n_kv_heads: int,
) -> Tensor:
    """Rotary embedding and the KV write of a fused QKV output ``[T, (n_heads + 2 n_kv_heads) d]``, one launch.

    IN PLACE: the Q and K heads of ``qkv`` are rotated where they lie (V is untouched); the rotated
    K and the V of every token whose ``slot_mapping`` entry (int32/int64) is >= 0 go into
    ``k_cache, v_cache [num_blocks, block_size, n_kv_heads, d]``. Returns the rotated Q, a
    ``[T, n_heads, d]`` view of ``qkv``. ``positions [T]`` int; ``cos_cache/sin_cache [max_pos, d]``
    in HF rotate_half layout. The grid is ``(T,)`` and nothing is read back to the host, so it
    can be captured in a CUDA graph.
    """
    T = qkv.shape[0]
    _, block_size, kv_heads, d = k_cache.shape
    assert kv_heads == n_kv_heads and d % 2 == 0 and qkv.shape[1] == (n_heads + 2 * n_kv_heads) * d
    assert qkv.stride(-1) == 1 and k_cache.stride(-1) == 1, "rows and cache heads must be contiguous"
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert cos_cache.shape[-1] == d and cos_cache.stride(-1) == 1 and sin_cache.shape == cos_cache.shape
    assert sin_cache.stride(-1) == 1 and positions.shape == (T,) and slot_mapping.shape == (T,)
    q = qkv[:, : n_heads * d].view(T, n_heads, d)
    if T == 0:
        return q
    half = d // 2
    _rotary_write_kv_kernel[(T,)](
        qkv, positions.contiguous(), cos_cache, sin_cache, slot_mapping.contiguous(), k_cache, v_cache,
        qkv.stride(0), cos_cache.stride(0), sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        n_heads, n_kv_heads, half, block_size,
        BLOCK_HQ=triton.next_power_of_2(n_heads),
        BLOCK_HK=triton.next_power_of_2(n_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q
