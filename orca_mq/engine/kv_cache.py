"""A stage's KV pool: pre-allocated paged K/V tensors for its layers (the worker side of the KV manager).

Which blocks belong to which request is the scheduler's `BlockManager`'s business; every stage
holds the same block ids for its own layers, so one block table addresses the whole pipeline.
FastServe offloads blocks to a host pool of the same layout and uploads them back (`copy_blocks`).
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

    def host_pool(self, num_blocks: int) -> "KVCache":
        """An empty pool shaped like this one in host memory, the target of offloads: pinned when this
        one is on CUDA (asynchronous copies); on CPU its pages are committed only once written."""
        shape = (self.k.shape[0], num_blocks, *self.k.shape[2:])
        pin = self.k.is_cuda
        return KVCache(torch.empty(shape, dtype=self.k.dtype, pin_memory=pin),
                       torch.empty(shape, dtype=self.k.dtype, pin_memory=pin))

    def copy_blocks(self, dst: "KVCache", pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V) to another pool: pairs of (block here, block in dst)."""
        if not pairs:
            return
        src_idx = torch.tensor([a for a, _ in pairs], device=self.k.device)
        dst_idx = torch.tensor([b for _, b in pairs], device=dst.k.device)
        for src, out in ((self.k, dst.k), (self.v, dst.v)):
            out.index_copy_(1, dst_idx, src.index_select(1, src_idx).to(out.device))
