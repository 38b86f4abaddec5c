"""Triton kernel: ragged paged attention for one selective-batching iteration.

ONE launch covers every request of the iteration, whatever its phase
(initiation: whole prompt, possibly with cached context; increment: one token)
-- the Triton analogue of ORCA fusing the per-request attentions by
concatenating their thread blocks.

Grid: ``(num_tiles, n_kv_heads)``. A program handles one *query tile* of one
request and one KV-head group: ``TOK`` consecutive query tokens x the ``G =
n_heads // n_kv_heads`` query heads that share the KV head, packed into
``BLOCK_R = TOK * G (+ padding)`` rows, so each K/V chunk is loaded once for
the whole group (GQA) and decode steps still fill several MMA rows.

Tile -> request map, computed in the kernel with no host sync: request ``b``
owns tiles ``start_b .. start_b + cdiv(q_len_b, TOK) - 1`` with
``start_b = cu_q_lens[b] // TOK + b``. These ranges are disjoint and increasing
and all fit below ``T // TOK + B`` (the grid size); a program finds its
request by counting ``start_b <= tile`` over the (small) ``cu_q_lens`` vector
and exits early when its tile is past the end of the request.

Each program walks the request's KV positions ``0 .. min(seq_len, last query
position + 1)`` in chunks of ``BLOCK_N`` keys, gathering each key's slot
through the block table (so any block_size works, block order is arbitrary,
and nothing past ``seq_len`` is ever loaded), with an online (flash-attention)
softmax in fp32. A layer's options: a sliding ``window`` starts the walk at the
tile's first visible key (blocks before it are never read) and masks by it;
``softcap`` caps the scaled scores (``c * tanh(s / c)``); ``sinks`` (a logit
per head) join each row's softmax denominator as a key of value zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["ragged_paged_attention"]

_LOG2E = 1.4426950408889634
# requests a program scans to find its own (one vector load): a floor this high leaves one compiled
# variant per tile shape up to 256 requests an iteration, at a cost of reading 1 KB more per program
MIN_BLOCK_B = 256


# Triton compiles a kernel per value class (1, a multiple of 16, other) of each int argument: the
# request count and the block tables' width change every iteration, and each new class would
# compile on the serving path (about a second each)
@triton.jit(do_not_specialize=["num_reqs", "stride_bt", "window"])
def _ragged_paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr,
    block_tables_ptr, cu_q_lens_ptr, seq_lens_ptr, sinks_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,  # 0: none; else a query at p sees keys k with p - k < window
    softcap,  # 0.0: none
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    num_reqs, block_size, head_dim,
    G: tl.constexpr,  # query heads per kv head
    TOK: tl.constexpr,  # query tokens per tile
    BLOCK_R: tl.constexpr,  # rows per tile (>= TOK * G, power of 2, >= 16)
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_D: tl.constexpr,  # padded head_dim
    BLOCK_B: tl.constexpr,  # padded num_reqs
    PREC: tl.constexpr,  # tl.dot input precision
    SOFTCAP: tl.constexpr,  # softcap > 0
    SINKS: tl.constexpr,  # sinks_ptr holds a logit per query head
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)

    # ---- which request does this tile belong to? ----
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < num_reqs
    cu = tl.load(cu_q_lens_ptr + offs_b, mask=b_mask, other=0)
    starts = cu // TOK + offs_b
    b = tl.sum(((starts <= tile) & b_mask).to(tl.int32), axis=0) - 1
    q_beg = tl.load(cu_q_lens_ptr + b)
    q_len = tl.load(cu_q_lens_ptr + b + 1) - q_beg
    m0 = (tile - (q_beg // TOK + b)) * TOK  # first query token of the tile, within the request
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # tokens cached before this iteration

    # ---- query rows: row r = (token r // G, head kvh * G + r % G) ----
    offs_r = tl.arange(0, BLOCK_R)
    tok = offs_r // G
    head = kvh * G + offs_r % G
    row_valid = (tok < TOK) & (m0 + tok < q_len)
    pos = ctx + m0 + tok  # absolute position of each row's query
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_row = (q_beg + m0 + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :], other=0.0,
    )

    if SINKS:  # a sink is a key scoring sinks[head] with a zero value: it starts the denominator
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)  # finite floor: no inf - inf
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)

    kv_end = tl.minimum(seq_len, ctx + m0 + TOK)  # causal: last key any row of the tile sees, + 1
    # a window: the tile's first query sees nothing before its position - window + 1
    kv_start = tl.where(window > 0, tl.maximum(ctx + m0 - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kvh.to(tl.int64) * stride_vh
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        blk = tl.load(bt_row + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
        off = (offs_n % block_size).to(tl.int64)
        kv_mask_t = d_mask[:, None] & n_valid[None, :]
        k_t = tl.load(  # [BLOCK_D, BLOCK_N]
            k_head + blk[None, :] * stride_kb + off[None, :] * stride_ks + offs_d[:, None] * stride_kd,
            mask=kv_mask_t, other=0.0,
        )
        qk = tl.dot(q, k_t, input_precision=PREC) * qk_scale  # [BLOCK_R, BLOCK_N], log2 domain
        if SOFTCAP:  # c * tanh(s / c) on the natural-log scores, tanh from exp (stable for either sign)
            x = qk / (softcap * 1.4426950408889634)
            e = tl.exp(-2.0 * tl.abs(x))
            qk = tl.where(x >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e) * (softcap * 1.4426950408889634)
        causal = (offs_n[None, :] <= pos[:, None]) & n_valid[None, :]
        causal = causal & ((offs_n[None, :] > pos[:, None] - window) | (window <= 0))
        qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(  # [BLOCK_N, BLOCK_D]
            v_head + blk[:, None] * stride_vb + off[:, None] * stride_vs + offs_d[None, :] * stride_vd,
            mask=n_valid[:, None] & d_mask[None, :], other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )


def ragged_paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_q_lens: Tensor,
    seq_lens: Tensor,
    scale: float,
    decode_tiles: bool | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal paged attention for all requests of an iteration, one kernel launch.

    ``q [T, n_heads, head_dim]`` (new tokens of all requests, request order);
    ``k_cache/v_cache [num_blocks, block_size, n_kv_heads, head_dim]`` already
    containing this iteration's K/V; ``block_tables [B, max_blocks]`` int32;
    ``cu_q_lens [B+1]`` int32; ``seq_lens [B]`` int32 (KV length including the
    new tokens); a layer's ``window``, ``softcap`` and ``sinks [n_heads]`` (module
    docstring). Returns a new ``[T, n_heads, head_dim]`` tensor in ``q.dtype``.
    No device->host synchronisation.
    """
    T, n_heads, head_dim = q.shape
    num_blocks, block_size, n_kv_heads, head_dim_kv = k_cache.shape
    assert head_dim_kv == head_dim and v_cache.shape == k_cache.shape
    assert n_heads % n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads"
    num_reqs = seq_lens.shape[0]
    assert cu_q_lens.shape == (num_reqs + 1,) and block_tables.shape[0] == num_reqs
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0 or num_reqs == 0:
        return out
    G = n_heads // n_kv_heads
    # decode-heavy batches (about one token per request): small tiles; prefill: bigger tiles (a caller
    # whose rows are padded, a CUDA graph's, says which its real rows are)
    BLOCK_R = 16 if (T <= 2 * num_reqs if decode_tiles is None else decode_tiles) else 64
    BLOCK_R = max(BLOCK_R, triton.next_power_of_2(G))
    TOK = BLOCK_R // G
    BLOCK_D = max(16, triton.next_power_of_2(head_dim))
    BLOCK_N = 64 if BLOCK_D <= 64 else 32
    cu_q_lens = cu_q_lens.contiguous()
    seq_lens = seq_lens.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    num_tiles = T // TOK + num_reqs
    _ragged_paged_attn_kernel[(num_tiles, n_kv_heads)](
        q, k_cache, v_cache, out,
        block_tables, cu_q_lens, seq_lens, seq_lens if sinks is None else sinks,
        float(scale) * _LOG2E, int(window), float(softcap),
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        num_reqs, block_size, head_dim,
        G=G, TOK=TOK, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        BLOCK_B=max(MIN_BLOCK_B, triton.next_power_of_2(num_reqs)),
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=softcap > 0, SINKS=sinks is not None,
        num_warps=4,
    )
    return out
