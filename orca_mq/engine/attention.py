"""Selective batching's one request-aware operation: attention split per request over the KV cache.

Every other operation sees the iteration as one flattened [T, H] tensor. `AttentionMetadata` is
built once per iteration and shared by all layers of a stage. The torch path (CPU) writes the
new K/V into the paged cache, then runs all increment requests together (the C++ kernel reading
blocks in place, or one padded SDPA batch) and each initiation request on its own; the Triton path
(CUDA) covers the whole iteration in one launch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from orca_mq.protocol.iteration import IterationPlan

if TYPE_CHECKING:
    from kernels.cpu_decode import PagedDecode

Tensor = torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    positions: Tensor        # [T] int64 position of every new token
    slot_mapping: Tensor     # [T] int64 cache slot (block * block_size + offset) of every new token
    cu_q_lens: Tensor        # [B+1] int32 offsets of each request's tokens in the flattened batch
    seq_lens: Tensor         # [B] int32 KV length after this iteration
    block_tables: Tensor     # [B, max_blocks] int32, padded with 0
    last_token_idx: Tensor   # [B] int64 each request's last new token (the LM head's rows)
    # torch path: increment requests batched, initiation requests one by one
    decode_tokens: Tensor    # [Bd] int64 token rows of the increment requests
    decode_blocks: Tensor    # [Bd, nb] int64 block ids each increment request attends to (0-padded)
    decode_lens: Tensor      # [Bd] int32 KV length of each increment request
    decode_mask: Tensor      # [Bd, 1, 1, nb * block_size] bool, False past the request's length
    prefills: list[tuple[int, int, int]]  # (first token row, q_len, start_pos) of each initiation request
    prefill_slots: list[Tensor | None]    # cached slots before start_pos (None when start_pos == 0)


def build_metadata(plan: IterationPlan, block_size: int, device: torch.device) -> AttentionMetadata:
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    last: list[int] = []
    decode_tokens: list[int] = []
    decode_seqs: list[tuple[list[int], int]] = []  # (block table, KV length)
    prefills: list[tuple[int, int, int]] = []
    prefill_slots: list[Tensor | None] = []
    max_blocks = max((len(s.block_table) for s in plan.seqs), default=1)
    tables = torch.zeros(len(plan.seqs), max_blocks, dtype=torch.int32)
    for b, s in enumerate(plan.seqs):
        q_len, row = len(s.token_ids), cu[-1]
        need = -(-s.seq_len // block_size)
        if len(s.block_table) < need:
            raise ValueError(f"request {s.req_id}: {len(s.block_table)} KV blocks cannot hold {s.seq_len} tokens")
        table = torch.tensor(s.block_table, dtype=torch.int64)
        tables[b, : len(s.block_table)] = table.to(torch.int32)
        seq_slots = (table[:need, None] * block_size + torch.arange(block_size)).flatten()[: s.seq_len]
        positions.extend(range(s.start_pos, s.seq_len))
        slots.extend(seq_slots[s.start_pos:].tolist())
        cu.append(row + q_len)
        last.append(row + q_len - 1)
        if q_len == 1:
            decode_tokens.append(row)
            decode_seqs.append((s.block_table[:need], s.seq_len))
        else:
            prefills.append((row, q_len, s.start_pos))
            prefill_slots.append(seq_slots[: s.start_pos].to(device) if s.start_pos else None)
    nb = max((len(t) for t, _ in decode_seqs), default=0)
    decode_blocks = torch.zeros(len(decode_seqs), nb, dtype=torch.int64)
    decode_mask = torch.zeros(len(decode_seqs), 1, 1, nb * block_size, dtype=torch.bool)
    for i, (table_i, n) in enumerate(decode_seqs):
        decode_blocks[i, : len(table_i)] = torch.tensor(table_i)
        decode_mask[i, ..., :n] = True

    def dev(x: list[int] | Tensor, dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.as_tensor(x, dtype=dtype).to(device)

    return AttentionMetadata(
        positions=dev(positions), slot_mapping=dev(slots), cu_q_lens=dev(cu, torch.int32),
        seq_lens=dev([s.seq_len for s in plan.seqs], torch.int32), block_tables=tables.to(device),
        last_token_idx=dev(last), decode_tokens=dev(decode_tokens), decode_blocks=decode_blocks.to(device),
        decode_lens=dev([n for _, n in decode_seqs], torch.int32), decode_mask=decode_mask.to(device),
        prefills=prefills, prefill_slots=prefill_slots,
    )


def write_kv_torch(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> None:
    kvh, d = k.shape[1:]
    k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)


def attention_torch(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                    meta: AttentionMetadata, scale: float, decode_kernel: PagedDecode | None = None) -> Tensor:
    """q [T, H, d], k/v [T, kvh, d] (this iteration's, already written to the cache) -> [T, H, d].
    `decode_kernel` (kernels/cpu_decode.py) reads the increment requests' blocks in place; without it
    they are gathered into a padded batch for SDPA."""
    n_heads, d = q.shape[1:]
    kvh = k.shape[1]
    group = n_heads // kvh
    out = torch.empty_like(q)
    k_flat, v_flat = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    if meta.decode_tokens.numel():
        qd = q.index_select(0, meta.decode_tokens)
        if decode_kernel is not None:
            od = decode_kernel(qd, k_cache, v_cache, meta.decode_blocks, meta.decode_lens, scale)
        else:
            bd, l_max = meta.decode_tokens.numel(), meta.decode_mask.shape[-1]
            # gather whole blocks (one row copy per block, not per token), padded to the longest request;
            # queries of one KV head's group share its keys: [Bd, kvh, group, d] needs no K/V repeat
            blocks = meta.decode_blocks.view(-1)
            kd = k_cache.index_select(0, blocks).view(bd, l_max, kvh, d).transpose(1, 2)
            vd = v_cache.index_select(0, blocks).view(bd, l_max, kvh, d).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd.view(bd, kvh, group, d), kd, vd, attn_mask=meta.decode_mask,
                                                scale=scale).reshape(bd, n_heads, d)
        out.index_copy_(0, meta.decode_tokens, od)
    for (row, q_len, start), cached in zip(meta.prefills, meta.prefill_slots):
        qp = q[row: row + q_len].transpose(0, 1).unsqueeze(0)           # [1, H, L, d]
        kp, vp = k[row: row + q_len], v[row: row + q_len]
        if cached is None:
            mask, causal = None, True
        else:  # prior context (e.g. chunked work): its keys are all visible, the new ones causally
            kp = torch.cat([k_flat.index_select(0, cached), kp])
            vp = torch.cat([v_flat.index_select(0, cached), vp])
            mask = torch.ones(q_len, start + q_len, dtype=torch.bool, device=q.device).tril(start)
            causal = False
        op = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1,
        )
        out[row: row + q_len] = op.squeeze(0).transpose(0, 1)
    return out
