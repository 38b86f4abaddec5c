"""A stage's KV pool: pre-allocated paged K/V tensors for its layers (the worker side of the KV manager).

Which blocks belong to which request is the scheduler's `BlockManager`'s business; every stage
holds the same block ids for its own layers, so one block table addresses the whole pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(slots=True)
class KVCache:
    k: Tensor   # [n_layers, num_blocks, block_size, n_kv_heads, head_dim]
    v: Tensor

    @classmethod
    def allocate(cls, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self.k[i], self.v[i]

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()
