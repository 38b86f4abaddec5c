"""A stage's KV pools: pre-allocated paged K/V tensors for its layers (the worker side of the KV manager).

Which blocks belong to which request is the scheduler's block manager's business; every stage
holds the same block ids for its own layers, so one block table addresses the whole pipeline.
FastServe offloads blocks to a host pool and uploads them back (swapper.py).
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

    def block_bytes(self) -> int:
        """Bytes of one block of tokens: its K and V in every layer."""
        return self.k[:, 0].nbytes + self.v[:, 0].nbytes

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self.k[i], self.v[i]


@dataclass(slots=True)
class HostKV:
    """The host pool, offload target: block-major [num_blocks, n_layers, block_size, n_kv_heads,
    head_dim], so each block is one contiguous buffer that a copy reads or writes whole: pinned when
    the device pool is on CUDA (asynchronous copies); on CPU its pages are committed only once written."""
    k: Tensor
    v: Tensor

    @classmethod
    def like(cls, kv: KVCache, num_blocks: int) -> "HostKV":
        shape = (num_blocks, kv.k.shape[0], *kv.k.shape[2:])
        pin = kv.k.is_cuda
        return cls(torch.empty(shape, dtype=kv.k.dtype, pin_memory=pin), torch.empty(shape, dtype=kv.k.dtype, pin_memory=pin))

    def offload(self, kv: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, host block) pairs here, all layers, K and V."""
        for d, h in pairs:
            self.k[h].copy_(kv.k[:, d], non_blocking=True)
            self.v[h].copy_(kv.v[:, d], non_blocking=True)

    def upload(self, kv: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy (host block, device block) pairs back to the device pool."""
        for h, d in pairs:
            kv.k[:, d].copy_(self.k[h], non_blocking=True)
            kv.v[:, d].copy_(self.v[h], non_blocking=True)
