"""Triton kernel: scatter the iteration's new K/V into the paged KV cache."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["write_kv"]


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    block_size, n_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    blk = slot // block_size
    off = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < n_kv_heads) & (offs_d[None, :] < head_dim)
    t64 = t.to(tl.int64)

    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write ``k, v [T, n_kv_heads, head_dim]`` into ``k_cache, v_cache`` in place.

    ``slot_mapping [T]`` (int32/int64) gives each token's slot
    ``block * block_size + offset``; negative slots are skipped. One launch, one
    program per token. ``k``/``v`` may be strided views (e.g. slices of a fused
    QKV output).
    """
    T = k.shape[0]
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape
    assert k.shape == (T, n_kv_heads, head_dim) and v.shape == k.shape
    assert slot_mapping.shape == (T,)
    if T == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        block_size, n_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(n_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
