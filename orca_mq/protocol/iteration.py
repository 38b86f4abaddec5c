"""What one engine iteration is: the control frame's payload and the tokens it returns.

The scheduler decides everything (which requests, which KV blocks, which swaps); every
pipeline stage applies the same plan to its own layers, so stages never disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MASK_WORD_BITS = 32   # an allowed-token bitmask is little-endian 32-bit words: bit i of word j allows token 32 j + i


def mask_bytes(vocab_size: int) -> int:
    """Size of one row's allowed-token bitmask (here, not in the sampler: the scheduler fills masks without torch)."""
    return -(-vocab_size // MASK_WORD_BITS) * MASK_WORD_BITS // 8


@dataclass(slots=True)
class SeqWork:
    """One request's share of an iteration (ORCA: INITIATION = whole prompt, INCREMENT = one token)."""

    request_id: str
    token_ids: list[int]          # new tokens this iteration
    start_pos: int                # tokens already in the KV cache = position of token_ids[0]
    block_table: list[int]        # device KV blocks covering start_pos + len(token_ids) tokens
    temperature: float = 0.0      # sampling, used by the last stage only
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    allowed_token_bitmask: bytes | None = None  # structured outputs: the grammar's allowed tokens, mask_bytes(vocab) long (engine/sampler.py)
    sample: bool = True           # False: a prompt chunk with more of the prompt to come: no logits, no token

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class IterationPlan:
    iteration: int
    seqs: list[SeqWork]
    # KV block copies every stage applies before computing this iteration (FastServe):
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device_block, host_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host_block, device_block)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(slots=True)
class IterationResult:
    iteration: int
    request_ids: list[str]
    token_ids: list[int]          # one sampled token per request, same order as the plan (-1 where it samples nothing)
    failed: list[str] = field(default_factory=list)  # requests whose work failed: they end with an error
