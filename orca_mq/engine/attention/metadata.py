"""What attention needs to know of an iteration's requests, built once and shared by all layers of a stage.

An attention row is one request's new tokens over its KV. In deterministic mode (`engine.deterministic`)
every new token is its own row, attending over its cache up to its own position: its output then
comes from the same kernel call shape whether its prompt ran whole, in chunks or on a cached prefix,
and whatever else shares the iteration.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from orca_mq.protocol.iteration import IterationPlan

Tensor = torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    positions: Tensor        # [T] int64 position of every new token
    slot_mapping: Tensor     # [T] int64 cache slot (block * block_size + offset) of every new token
    cu_q_lens: Tensor        # [B+1] int32 offsets of each attention row's tokens in the flattened batch
    seq_lens: Tensor         # [B] int32 KV length of each attention row after this iteration
    block_tables: Tensor     # [B, max_blocks] int32, padded with 0
    logit_rows: Tensor       # [S] int64 the last new token of each request that samples (the LM head's rows)
    # torch and cpu paths: rows of one token batched, initiation requests one by one
    decode_tokens: Tensor    # [Bd] int64 token rows of the increment requests (deterministic: every token)
    decode_blocks: Tensor    # [Bd, nb] int64 block ids each increment request attends to (0-padded)
    decode_lens: Tensor      # [Bd] int32 KV length of each increment request
    decode_mask: Tensor      # [Bd, 1, 1, nb * block_size] bool, False past the request's length
    prefills: list[tuple[int, int, int]]  # (first token row, q_len, start_pos) of each initiation request
    prefill_slots: list[Tensor | None]    # cached slots before start_pos (None when start_pos == 0)


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions start..end-1 through a block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_metadata(plan: IterationPlan, block_size: int, device: torch.device,
                   token_rows: bool = False) -> AttentionMetadata:
    """Plain-list arithmetic, one tensor per field: at batch 64 per-request tensor ops cost more than
    the lists (this runs on the critical path of every iteration). `token_rows`: every new token is
    its own attention row (deterministic mode)."""
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    tables: list[list[int]] = []
    decode_tokens: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    kv_lens: list[int] = []
    prefills: list[tuple[int, int, int]] = []
    prefill_slots: list[Tensor | None] = []
    sample_rows: list[int] = []
    for s in plan.seqs:
        q_len, row, seq_len = len(s.token_ids), len(positions), s.seq_len
        need = -(-seq_len // block_size)
        if len(s.block_table) < need:
            raise ValueError(f"request {s.request_id}: {len(s.block_table)} KV blocks cannot hold {seq_len} tokens")
        positions.extend(range(s.start_pos, seq_len))
        slots.extend(_slots(s.block_table, s.start_pos, seq_len, block_size))
        if s.sample:
            sample_rows.append(row + q_len - 1)
        if q_len == 1 or token_rows:
            for r, pos in enumerate(range(s.start_pos, seq_len), row):
                table = s.block_table[: -(-(pos + 1) // block_size)]
                tables.append(table)
                cu.append(r + 1)
                kv_lens.append(pos + 1)
                decode_tokens.append(r)
                decode_tables.append(table)
                decode_lens.append(pos + 1)
            continue
        tables.append(s.block_table)
        cu.append(row + q_len)
        kv_lens.append(seq_len)
        prefills.append((row, q_len, s.start_pos))
        cached = _slots(s.block_table, 0, s.start_pos, block_size)
        prefill_slots.append(torch.tensor(cached, dtype=torch.int64, device=device) if cached else None)
    max_blocks = max((len(t) for t in tables), default=1)
    nb = max((len(t) for t in decode_tables), default=0)

    def dev(x: list[int] | list[list[int]], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(x, dtype=dtype).to(device)

    lens = dev(decode_lens, torch.int32)
    return AttentionMetadata(
        positions=dev(positions), slot_mapping=dev(slots), cu_q_lens=dev(cu, torch.int32),
        seq_lens=dev(kv_lens, torch.int32),
        block_tables=dev([t + [0] * (max_blocks - len(t)) for t in tables], torch.int32).view(len(tables), max_blocks),
        logit_rows=dev(sample_rows), decode_tokens=dev(decode_tokens),
        decode_blocks=dev([t + [0] * (nb - len(t)) for t in decode_tables]).view(len(decode_tables), nb),
        decode_lens=lens,
        decode_mask=(torch.arange(nb * block_size, device=device) < lens[:, None]).view(len(decode_lens), 1, 1, nb * block_size),
        prefills=prefills, prefill_slots=prefill_slots,
    )
