"""What attention needs to know of an iteration's requests, shared by all layers of a stage.

An attention row is one request's new tokens over its KV. In deterministic mode (`engine.deterministic`)
every new token is its own row, attending over its cache up to its own position: its output then
comes from the same kernel call shape whether its prompt ran whole, in chunks or on a cached prefix,
and whatever else shares the iteration. Built by orca_mq/engine/step_inputs.py, as views of the
iteration's one input buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    positions: Tensor        # [T] int64 position of every new token
    slot_mapping: Tensor     # [T] int64 cache slot (block * block_size + offset) of every new token
    cu_q_lens: Tensor        # [B+1] int32 offsets of each attention row's tokens in the flattened batch
    seq_lens: Tensor         # [B] int32 KV length of each attention row after this iteration
    block_tables: Tensor     # [B, max_blocks] int32, padded with 0
    logit_rows: Tensor       # [S] int64 the new tokens that sample (the LM head's rows)
    # torch and cpu paths: rows of one token batched, initiation requests one by one (empty on triton)
    decode_tokens: Tensor    # [Bd] int64 token rows of the increment requests (deterministic: every token)
    decode_blocks: Tensor    # [Bd, nb] int64 block ids each increment request attends to (0-padded)
    decode_lens: Tensor      # [Bd] int32 KV length of each increment request
    prefills: list[tuple[int, int, int]]  # (first token row, q_len, start_pos) of each initiation request
    prefill_slots: list[Tensor | None]    # cached slots before start_pos (None when start_pos == 0)
    decode_tiles: bool | None = None      # triton: tiles of one-token rows or of prompt chunks (None: from the shape)
    prompt_rows: Tensor | None = None     # [P] int64 prompt positions whose logits are asked (prompt logprobs), after logit_rows'
    pool_rows: Tensor | None = None       # [N] int64 token rows whose final-norm output is pooled (embeddings; no LM head)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """One layer's attention as the kernels compute it (what a family sets per layer)."""

    scale: float
    window: int = 0                 # > 0: a query at position p sees keys at p - window < k <= p
    softcap: float = 0.0            # > 0: scaled scores s -> softcap * tanh(s / softcap) (Gemma 2)
    sinks: Tensor | None = None     # [n_heads] logits that join each head's softmax denominator (gpt-oss)

    @property
    def plain(self) -> bool:
        """Causal softmax attention and nothing else (SDPA computes it)."""
        return not self.softcap and self.sinks is None
