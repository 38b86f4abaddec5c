"""The scheduler side of the KV manager: which fixed-size KV blocks each request owns.

Allocation failure raises `KVAllocationError`; ORCA's reservation (n_rsrv) guarantees it never
happens under that policy, and FastServe offloads before it can.
"""
from __future__ import annotations

from collections import deque


class KVAllocationError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs >= 1 block of >= 1 slot, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_blocks) * self.block_size

    @property
    def num_used_slots(self) -> int:
        return (self.num_blocks - len(self.free_blocks)) * self.block_size

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def ensure(self, request_id: str, n_tokens: int) -> list[int]:
        """Grow the request's block table to hold n_tokens tokens; returns the table."""
        table = self.tables.get(request_id, [])
        missing = self.blocks_for(n_tokens) - len(table)
        if missing > len(self.free_blocks):
            raise KVAllocationError(
                f"request {request_id}: needs {missing} more KV blocks, {len(self.free_blocks)} free"
            )
        self.tables[request_id] = table
        for _ in range(max(0, missing)):
            table.append(self.free_blocks.popleft())
        return table

    def take(self, n: int) -> list[int]:
        """n free blocks not yet owned by a request (FastServe uploads them before assigning)."""
        if n > len(self.free_blocks):
            raise KVAllocationError(f"needs {n} KV blocks, {len(self.free_blocks)} free")
        return [self.free_blocks.popleft() for _ in range(n)]

    def assign(self, request_id: str, blocks: list[int]) -> None:
        self.tables[request_id] = blocks

    def free(self, request_id: str) -> list[int]:
        blocks = self.tables.pop(request_id, [])
        self.free_blocks.extend(blocks)
        return blocks
