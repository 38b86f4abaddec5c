"""Triton kernels: split-KV decoding (flash-decoding) for iterations of one-token rows.

The ragged kernel (attention_kernel.py) gives a decode row one program per KV head, which walks
the row's whole context: at batch x KV heads below the card's SM count most of the card idles
while a few programs read long contexts. Here each row's context is divided across `num_splits`
programs: grid ``(rows, n_kv_heads, num_splits)``, each program the G query heads of one KV head
(GQA: each key loaded once for the group) over its share of the keys, with an online softmax in
fp32; it leaves its partial (max, sum, unnormalised output) and a second, small kernel merges a
row's splits (grid ``(rows, n_heads)``). A split's share is the row's own visible span (its
window's, when it has one) divided evenly, in whole BLOCK_N steps, so the work follows each row's
real length while the launch depends only on host-known shapes (a CUDA graph captures it as is).

When (`num_splits`, documented in `choose_splits`): rows x KV heads below the SM count (the ragged
kernel fills the card otherwise), splits enough for about WAVES programs per SM, each at least
MIN_SPLIT_KEYS keys of the longest context the block tables can hold, at most MAX_SPLITS.

Per-layer options, as the model families need them (issue 40):
- ``window`` (0 = none): the query at position p sees keys k with p - k < window;
- ``softcap`` (0 = off): scores s -> softcap * tanh(s / softcap) after scaling, before the softmax;
- ``sinks`` ([n_heads] float32 logits or None): each joins its head's softmax denominator only
  (gpt-oss's attention sinks), in the merge.
- KV in e4m3 (``k_scale``/``v_scale`` [num_blocks, block_size, n_kv_heads] float32, a scale per token
  and KV head): keys and values are loaded as e4m3, the K scale multiplies the scores' columns and
  the V scale the probabilities' (no dequantized copy is made).

Keys, values and queries are computed on in fp32 (tf32 dot products on a GPU, which hold bf16 and
e4m3 values exactly; ieee for fp32 inputs): the interpreter's bf16 dot is wrong (triton-lang/triton#11584),
so the bf16 path is the one the tests check too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["Tiles", "choose_splits", "split_kv_decode"]

_LOG2E = 1.4426950408889634
WAVES = 2              # programs per SM the splits aim for
MIN_SPLIT_KEYS = 128   # keys a split covers at least (of the longest context the tables hold)
MAX_SPLITS = 64
INTERPRETER_SMS = 132  # no GPU (TRITON_INTERPRET=1): an H100's count stands in


@dataclass(frozen=True, slots=True)
class Tiles:
    """The split kernel's launch shape; tools/gpu_check.py's `tune` section sweeps it on a GPU. The
    default is the sweep's on an H100 (Llama 3 8B's heads, 32k keys, bf16): 64 keys a step in two
    stages read KV at 60 % / 79 % of the copy bandwidth at batch 1 / 4 where 32 keys in Triton's
    default three read 49 % / 58 % (BENCHMARKS.md)."""

    block_n: int = 0      # keys a program loads per step (0: 64 up to head_dim 128, 32 above: registers)
    num_warps: int = 4
    num_stages: int = 2   # software-pipelined loads in flight (0: Triton's default)

    def launch(self, block_d: int) -> dict[str, int]:
        shape = {"BLOCK_N": self.block_n or (64 if block_d <= 128 else 32), "num_warps": self.num_warps}
        return shape | ({"num_stages": self.num_stages} if self.num_stages else {})


TILES = Tiles()


@triton.jit(do_not_specialize=["stride_bt", "num_splits", "window"])
def _split_kv_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, m_ptr, l_ptr, acc_ptr,
    scale, softcap, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_sb, stride_ss, stride_sh,
    stride_bt, block_size, head_dim, num_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    per = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per
    end = tl.minimum(start + per, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    g_valid = offs_g < G
    head = kvh * G + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)   # finite floor: an empty split merges as nothing
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kvh.to(tl.int64) * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        blk = tl.load(bt_row + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
        off = (offs_n % block_size).to(tl.int64)
        k_t = tl.load(k_head + blk[None, :] * stride_kb + off[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                      mask=d_mask[:, None] & n_valid[None, :], other=0.0).to(tl.float32)   # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k_t, input_precision=PREC) * scale                                   # [BLOCK_G, BLOCK_N]
        if FP8:
            sc = kvh.to(tl.int64) * stride_sh + blk * stride_sb + off * stride_ss
            s = s * tl.load(k_scale_ptr + sc, mask=n_valid, other=0.0)[None, :]
        if SOFTCAP:   # softcap * tanh(s / softcap), tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)
            e = tl.exp(-2.0 * tl.abs(s / softcap))
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(s < 0, -t, t)
        s = tl.where(n_valid[None, :], s * 1.4426950408889634, float("-inf"))   # the log2 domain
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head + blk[:, None] * stride_vb + off[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                    mask=n_valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)   # [BLOCK_N, BLOCK_D]
        if FP8:
            p = p * tl.load(v_scale_ptr + sc, mask=n_valid, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new

    n_heads = tl.num_programs(1) * G
    part = (b * n_heads + head).to(tl.int64) * num_splits + split   # partials [rows, n_heads, num_splits(, D)]
    tl.store(m_ptr + part, m_i, mask=g_valid)
    tl.store(l_ptr + part, l_i, mask=g_valid)
    tl.store(acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_valid[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    m_ptr, l_ptr, acc_ptr, sinks_ptr, o_ptr,
    stride_ot, stride_oh, stride_od, head_dim, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < num_splits
    part = (b * tl.num_programs(1) + h).to(tl.int64) * num_splits + offs_s
    m = tl.load(m_ptr + part, mask=s_valid, other=-1.0e30)
    top = tl.max(m, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    w = tl.where(s_valid, tl.math.exp2(m - top), 0.0)
    denom = tl.sum(w * tl.load(l_ptr + part, mask=s_valid, other=0.0), axis=0)
    if SINKS:
        denom += tl.math.exp2(sink - top)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_valid[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d * stride_od, out.to(o_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else INTERPRETER_SMS


def choose_splits(rows: int, n_kv_heads: int, max_keys: int, sms: int) -> int:
    """Programs per row's KV head: 1 (the ragged kernel) when rows x KV heads fill the `sms` SMs;
    else enough for WAVES programs per SM, no fewer than MIN_SPLIT_KEYS of the `max_keys` the block
    tables can hold in each, at most MAX_SPLITS."""
    programs = rows * n_kv_heads
    if programs >= sms:
        return 1
    return max(1, min(-(-WAVES * sms // programs), -(-max_keys // MIN_SPLIT_KEYS), MAX_SPLITS))


def split_kv_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float,
                    num_splits: int, *, window: int = 0, softcap: float = 0.0, sinks: Tensor | None = None,
                    k_scale: Tensor | None = None, v_scale: Tensor | None = None, tiles: Tiles = TILES) -> Tensor:
    """One query per row ``q [B, n_heads, d]`` over its paged KV (``k_cache, v_cache [num_blocks,
    block_size, n_kv_heads, d]``, this iteration's key already written; e4m3 with ``k_scale, v_scale``),
    ``block_tables [B, width]`` int32, ``seq_lens [B]`` int32 (its KV length, its own key included)
    -> ``[B, n_heads, d]`` in q's dtype. Two launches, no host synchronisation."""
    rows, n_heads, d = q.shape
    _, block_size, n_kv_heads, d_kv = k_cache.shape
    assert d_kv == d and v_cache.shape == k_cache.shape and n_heads % n_kv_heads == 0
    assert seq_lens.shape == (rows,) and block_tables.shape[0] == rows and num_splits >= 1
    fp8 = k_scale is not None
    assert fp8 == (v_scale is not None) and (not fp8 or k_scale.shape == k_cache.shape[:3] == v_scale.shape)
    assert sinks is None or sinks.shape == (n_heads,)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    g = n_heads // n_kv_heads
    block_d = max(16, triton.next_power_of_2(d))
    m = torch.empty(rows, n_heads, num_splits, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    acc = torch.empty(rows, n_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    scales = (k_scale, v_scale) if fp8 else (m, m)   # unread without FP8
    _split_kv_kernel[(rows, n_kv_heads, num_splits)](
        q, k_cache, v_cache, *scales, block_tables, seq_lens.contiguous(), m, lse, acc,
        float(scale), float(softcap), int(window),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *(k_scale.stride() if fp8 else (0, 0, 0)),
        block_tables.stride(0), block_size, d, num_splits,
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=block_d,
        FP8=fp8, SOFTCAP=softcap > 0, PREC="ieee" if q.dtype == torch.float32 else "tf32", **tiles.launch(block_d),
    )
    _merge_kernel[(rows, n_heads)](
        m, lse, acc, m if sinks is None else sinks, out, *out.stride(), d, num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, SINKS=sinks is not None, num_warps=1,
    )
    return out


def decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float, *,
           window: int = 0, softcap: float = 0.0, sinks: Tensor | None = None, k_scale: Tensor | None = None,
           v_scale: Tensor | None = None) -> Tensor | None:
    """The attention backend's split-KV path: the output of an iteration of one-token rows whose
    rows x KV heads leave the card idle (`choose_splits`), else None (the ragged kernel runs)."""
    rows = q.shape[0]
    if rows != seq_lens.shape[0]:
        return None
    splits = choose_splits(rows, k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1], sm_count(q.device))
    if splits == 1:
        return None
    return split_kv_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, splits, window=window, softcap=softcap,
                           sinks=sinks, k_scale=k_scale, v_scale=v_scale)
