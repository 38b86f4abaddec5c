"""Plain-torch reference implementations of the selective-batching kernels.

These are the ground truth the Triton kernels (``kernels/*_kernel.py``) are
tested against. They favour obviously-correct code over speed (per-request
Python loops are fine) and never import triton, so they work everywhere.

KV layout (fixed by the engine), per pipeline stage and per layer:
    k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim]
    slot of a token = block * block_size + offset
Iteration metadata (all tokens of the iteration flattened in request order):
    cu_q_lens    [B+1] int32  prefix sums of the new-token counts q_len[b]
    seq_lens     [B]   int32  KV length after this iteration (includes new tokens)
    block_tables [B, max_blocks] int32, padded with 0 (never read past seq_len)
    slot_mapping [T]   int64  cache slot of each new token (negative = skip)
Grouped-query attention: query head h reads kv head h // (n_heads // n_kv_heads)
(Hugging Face ``repeat_kv`` convention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "write_kv_ref",
    "ragged_paged_attention_ref",
    "rms_norm_ref",
    "fused_add_rms_norm_ref",
    "rotary_ref",
    "rotary_write_kv_ref",
    "silu_mul_ref",
]


def write_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter new K/V ``[T, n_kv_heads, head_dim]`` into the paged cache, in place.

    Token ``t`` goes to slot ``slot_mapping[t]``; tokens with a negative slot
    are skipped (padding convention). Values are cast to the cache dtype.
    """
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    assert k.shape == v.shape and k.shape[1:] == (n_kv_heads, head_dim)
    for t in range(k.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        blk, off = divmod(slot, block_size)
        k_cache[blk, off] = k[t].to(k_cache.dtype)
        v_cache[blk, off] = v[t].to(v_cache.dtype)


def _gather_kv(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """Contiguous ``[seq_len, n_kv_heads, head_dim]`` copy of one request's cache (one gather on the
    cache's device: a per-position loop would synchronise with a GPU once per key)."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    return cache[block_table[pos // block_size].long(), pos % block_size]


def ragged_paged_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_q_lens: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention of the iteration's new queries over each request's cached K/V.

    ``q`` is ``[T, n_heads, head_dim]``; returns ``[T, n_heads, head_dim]`` in
    ``q.dtype`` (computed in fp32). Request ``b`` owns query rows
    ``cu_q_lens[b]:cu_q_lens[b+1]`` at positions ``seq_len-q_len .. seq_len-1``
    and attends keys at positions ``0..p`` (its own request only), read from the
    cache through ``block_tables[b]``. The new K/V must already be in the cache.
    A layer's options, as transformers' eager attention applies them: ``window``
    > 0 keeps keys ``k > p - window``; ``softcap`` > 0 maps scaled scores ``s`` to
    ``softcap * tanh(s / softcap)``; ``sinks [n_heads]`` join each softmax's
    denominator (their column dropped after).
    """
    T, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    assert n_heads % n_kv_heads == 0
    group = n_heads // n_kv_heads
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        q0, q1 = int(cu_q_lens[b]), int(cu_q_lens[b + 1])
        q_len, seq_len = q1 - q0, int(seq_lens[b])
        if q_len == 0:
            continue
        assert 1 <= q_len <= seq_len
        ctx = seq_len - q_len
        k = _gather_kv(k_cache, block_tables[b], seq_len).float()  # [S, kvh, d]
        v = _gather_kv(v_cache, block_tables[b], seq_len).float()
        k = k.repeat_interleave(group, dim=1)  # [S, H, d]; head h -> kv head h // group
        v = v.repeat_interleave(group, dim=1)
        qb = q[q0:q1].float()  # [L, H, d]
        scores = torch.einsum("lhd,shd->hls", qb, k) * scale  # [H, L, S]
        q_pos = torch.arange(ctx, seq_len, device=q.device).view(-1, 1)  # the scores' device (CUDA in the bench)
        k_pos = torch.arange(seq_len, device=q.device).view(1, -1)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        hidden = k_pos > q_pos
        if window:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hls,shd->lhd", probs, v).to(q.dtype)
    return out


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama RMSNorm over the last dim of ``x [T, hidden]``; returns ``x.dtype``.

    Follows Hugging Face ``LlamaRMSNorm`` rounding: normalise in fp32, round to
    ``x.dtype``, then multiply by ``weight`` (for fp32 that is just
    ``x * rsqrt(mean(x^2) + eps) * weight``).
    """
    x32 = x.float()
    var = x32.pow(2).mean(dim=-1, keepdim=True)
    normed = (x32 * torch.rsqrt(var + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def fused_add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``new_residual = x + residual`` (in ``x.dtype``), ``normed = rms_norm(new_residual)``.

    Returns ``(normed, new_residual)``; inputs are not modified.
    """
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_ref(
    q: Tensor, k: Tensor, positions: Tensor, cos_cache: Tensor, sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    """Rotary embedding, HF "rotate_half" (non-interleaved) layout. Out of place.

    ``q [T, H, d]``, ``k [T, kvh, d]``, ``positions [T]``, ``cos/sin_cache
    [max_pos, d]``: ``out = x*cos[pos] + rotate_half(x)*sin[pos]`` with
    ``rotate_half(x) = cat(-x2, x1)``. Computed in fp32, returned as new
    tensors in the input dtypes.
    """
    cos = cos_cache[positions].float().unsqueeze(1)  # [T, 1, d]
    sin = sin_cache[positions].float().unsqueeze(1)
    q32, k32 = q.float(), k.float()
    q_out = q32 * cos + _rotate_half(q32) * sin
    k_out = k32 * cos + _rotate_half(k32) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


def rotary_write_kv_ref(
    qkv: Tensor, positions: Tensor, cos_cache: Tensor, sin_cache: Tensor, slot_mapping: Tensor,
    k_cache: Tensor, v_cache: Tensor, n_heads: int, n_kv_heads: int,
) -> Tensor:
    """``rotary_ref`` then ``write_kv_ref`` on a fused QKV output ``[T, (n_heads + 2 n_kv_heads) d]``.

    IN PLACE: the Q and K heads of ``qkv`` are rotated where they lie (V is untouched), the
    rotated K and the V of every token with a slot >= 0 go into the caches. Returns the rotated
    Q, a ``[T, n_heads, d]`` view of ``qkv``.
    """
    t, d = qkv.shape[0], k_cache.shape[-1]
    q = qkv[:, : n_heads * d].view(t, n_heads, d)
    k = qkv[:, n_heads * d: (n_heads + n_kv_heads) * d].view(t, n_kv_heads, d)
    v = qkv[:, (n_heads + n_kv_heads) * d:].view(t, n_kv_heads, d)
    q_rot, k_rot = rotary_ref(q, k, positions, cos_cache, sin_cache)
    q.copy_(q_rot)
    k.copy_(k_rot)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """``[T, 2n] = [gate | up] -> silu(gate) * up [T, n]`` as torch (and HF's LlamaMLP) computes it:
    silu rounded to the dtype before the product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
