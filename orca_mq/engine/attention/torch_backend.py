"""Attention in plain torch ops: any device and dtype.

All increment requests run together (their blocks gathered into one padded SDPA batch), each
initiation request (or prompt chunk, on top of its cached context) on its own.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from orca_mq.engine.attention.base import register
from orca_mq.engine.attention.metadata import AttentionMetadata
from orca_mq.engine.layer_ops import LayerOps, TorchOps

Tensor = torch.Tensor


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

    def decode(self, qd: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        """The increment requests' one query each [Bd, H, d] over their paged KV -> [Bd, H, d]."""
        n_heads, d = qd.shape[1:]
        kvh = k_cache.shape[2]
        bd, l_max = meta.decode_tokens.numel(), meta.decode_blocks.shape[1] * k_cache.shape[1]
        mask = (torch.arange(l_max, device=qd.device) < meta.decode_lens[:, None]).view(bd, 1, 1, l_max)
        # gather whole blocks (one row copy per block, not per token), padded to the longest request;
        # queries of one KV head's group share its keys: [Bd, kvh, group, d] needs no K/V repeat
        blocks = meta.decode_blocks.view(-1)
        kd = k_cache.index_select(0, blocks).view(bd, l_max, kvh, d).transpose(1, 2)
        vd = v_cache.index_select(0, blocks).view(bd, l_max, kvh, d).transpose(1, 2)
        return F.scaled_dot_product_attention(qd.view(bd, kvh, n_heads // kvh, d), kd, vd, attn_mask=mask,
                                              scale=scale).reshape(bd, n_heads, d)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
               meta: AttentionMetadata, scale: float) -> Tensor:
        n_heads, d = q.shape[1:]
        kvh = k.shape[1]
        out = torch.empty_like(q)
        if meta.decode_tokens.numel():
            out.index_copy_(0, meta.decode_tokens,
                            self.decode(q.index_select(0, meta.decode_tokens), k_cache, v_cache, meta, scale))
        k_flat, v_flat = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
        for (row, q_len, start), cached in zip(meta.prefills, meta.prefill_slots):
            qp = q[row: row + q_len].transpose(0, 1).unsqueeze(0)           # [1, H, L, d]
            kp, vp = k[row: row + q_len], v[row: row + q_len]
            if cached is None:
                mask, causal = None, True
            else:  # a prompt chunk on cached context: the cached keys all visible, the new ones causally
                kp = torch.cat([k_flat.index_select(0, cached), kp])
                vp = torch.cat([v_flat.index_select(0, cached), vp])
                mask = torch.ones(q_len, start + q_len, dtype=torch.bool, device=q.device).tril(start)
                causal = False
            op = F.scaled_dot_product_attention(
                qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=n_heads != kvh,
            )
            out[row: row + q_len] = op.squeeze(0).transpose(0, 1)
        return out
