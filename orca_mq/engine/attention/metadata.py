"""What attention needs to know of an iteration's requests, built once and shared by all layers of a stage."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from orca_mq.protocol.iteration import IterationPlan

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
