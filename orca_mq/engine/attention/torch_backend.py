"""Attention in plain torch ops: any device and dtype.

All increment requests run together (their blocks gathered into one padded batch), each initiation
request (or prompt chunk, on top of its cached context) on its own. Plain causal attention (windowed
or not) runs through SDPA with a mask; a layer with soft-capping or sinks through the same arithmetic
written out (scores, cap, mask, softmax with the sinks in its denominator, values), as transformers'
eager attention computes it.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from orca_mq.engine.attention.base import register
from orca_mq.engine.attention.metadata import AttentionMetadata, AttentionSpec
from orca_mq.engine.layer_ops import LayerOps, TorchOps

Tensor = torch.Tensor


def eager(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: AttentionSpec) -> Tensor:
    """Soft-capped or sunk attention, in float32: q [B, kvh, g, L, d] (a KV head's group of query heads)
    over k, v [B, kvh, S, d]; mask broadcasts to [B, kvh, g, L, S] (True: visible; None: causal)."""
    s = torch.einsum("bhgld,bhsd->bhgls", q.float(), k.float()) * spec.scale
    if spec.softcap:
        s = torch.tanh(s / spec.softcap) * spec.softcap
    if mask is None:
        n, m = s.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool, device=s.device).tril(m - n)
    s = s.masked_fill(~mask, float("-inf"))
    if spec.sinks is not None:
        sinks = spec.sinks.float().view(1, k.shape[1], -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("bhgls,bhsd->bhgld", p, v.float()).to(q.dtype)


@register("torch")
class TorchAttention:
    name: ClassVar[str] = "torch"
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    split_decode: ClassVar[bool] = True   # one-token rows batched apart from prompts (metadata's decode_* fields)
    fused_rotary_kv: ClassVar[bool] = False
    ops: LayerOps = TorchOps()
    __slots__ = ()

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype) -> "TorchAttention":
        return cls()

    def write_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> None:
        kvh, d = k.shape[1:]
        k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)

    def decode(self, qd: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, spec: AttentionSpec) -> Tensor:
        """The increment requests' one query each [Bd, H, d] over their paged KV -> [Bd, H, d]."""
        n_heads, d = qd.shape[1:]
        kvh = k_cache.shape[2]
        bd, l_max = meta.decode_tokens.numel(), meta.decode_blocks.shape[1] * k_cache.shape[1]
        keys = torch.arange(l_max, device=qd.device)
        lens = meta.decode_lens[:, None]
        mask = keys < lens
        if spec.window:
            mask &= keys >= lens - spec.window
        # gather whole blocks (one row copy per block, not per token), padded to the longest request;
        # queries of one KV head's group share its keys: [Bd, kvh, group, d] needs no K/V repeat
        blocks = meta.decode_blocks.view(-1)
        kd = k_cache.index_select(0, blocks).view(bd, l_max, kvh, d).transpose(1, 2)
        vd = v_cache.index_select(0, blocks).view(bd, l_max, kvh, d).transpose(1, 2)
        if not spec.plain:
            return eager(qd.view(bd, kvh, n_heads // kvh, 1, d), kd, vd, mask.view(bd, 1, 1, 1, l_max), spec).reshape(bd, n_heads, d)
        return F.scaled_dot_product_attention(qd.view(bd, kvh, n_heads // kvh, d), kd, vd, attn_mask=mask.view(bd, 1, 1, l_max),
                                              scale=spec.scale).reshape(bd, n_heads, d)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
               meta: AttentionMetadata, spec: AttentionSpec) -> Tensor:
        n_heads, d = q.shape[1:]
        kvh = k.shape[1]
        out = torch.empty_like(q)
        if meta.decode_tokens.numel():
            out.index_copy_(0, meta.decode_tokens,
                            self.decode(q.index_select(0, meta.decode_tokens), k_cache, v_cache, meta, spec))
        k_flat, v_flat = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
        for (row, q_len, start), cached in zip(meta.prefills, meta.prefill_slots):
            qp = q[row: row + q_len].transpose(0, 1).unsqueeze(0)           # [1, H, L, d]
            kp, vp = k[row: row + q_len], v[row: row + q_len]
            if cached is not None:   # a prompt chunk on cached context: the cached keys, then the new ones
                kp = torch.cat([k_flat.index_select(0, cached), kp])
                vp = torch.cat([v_flat.index_select(0, cached), vp])
            mask = None
            if cached is not None or spec.window:
                keys, pos = torch.arange(start + q_len, device=q.device), torch.arange(start, start + q_len, device=q.device)
                mask = keys <= pos[:, None]
                if spec.window:
                    mask &= keys > pos[:, None] - spec.window
            kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)   # [1, kvh, S, d]
            if spec.plain:
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=spec.scale,
                                                    enable_gqa=n_heads != kvh)
            else:
                op = eager(qp.view(1, kvh, n_heads // kvh, q_len, d), kp, vp, mask, spec)
            out[row: row + q_len] = op.reshape(n_heads, q_len, d).transpose(0, 1)
        return out
