"""One memory's KV blocks (the device pool, or the host pool): which request holds which blocks,
how many references each block has, and which blocks are cached for reuse by prefix hash.

A block is in exactly one state: free (no references, nothing kept), referenced (held by request
tables or pinned by the plan being built), or idle (no references, but it holds computed K/V under
a prefix hash: cached until an allocation needs it, least recently released first).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class Tier:
    num_blocks: int
    free: deque[int] = field(init=False)
    ref: list[int] = field(init=False)
    tables: dict[str, list[int]] = field(default_factory=dict)
    index: dict[bytes, int] = field(default_factory=dict)       # prefix hash -> the block caching it
    hash_of: dict[int, bytes] = field(default_factory=dict)     # block -> its prefix hash (indexed blocks)
    idle: OrderedDict[int, None] = field(default_factory=OrderedDict)   # indexed, unreferenced: LRU first
    n_referenced: int = 0

    def __post_init__(self) -> None:
        self.free = deque(range(self.num_blocks))
        self.ref = [0] * self.num_blocks

    @property
    def available(self) -> int:
        """Blocks an allocation may take: the free ones and the idle cached ones (evicted)."""
        return len(self.free) + len(self.idle)

    def acquire(self, block: int) -> None:
        """One more reference to a block that holds something (a cache hit, a pin)."""
        if self.ref[block] == 0:
            del self.idle[block]
            self.n_referenced += 1
        self.ref[block] += 1

    def drop(self, block: int) -> None:
        """One reference less; with none left the block is cached if indexed, else free."""
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.n_referenced -= 1
            if block in self.hash_of:
                self.idle[block] = None
            else:
                self.free.append(block)

    def take(self, n: int) -> tuple[list[int], list[tuple[int, bytes]]]:
        """n blocks, one reference each: free ones first, then the least recently used idle ones,
        which leave the cache (returned as (block, hash) so that a lower tier may keep them)."""
        if n > self.available:
            raise KVAllocationError(f"needs {n} KV blocks, {self.available} free")
        blocks, evicted = [], []
        for _ in range(n):
            if self.free:
                block = self.free.popleft()
            else:
                block, _ = self.idle.popitem(last=False)
                evicted.append((block, self.hash_of.pop(block)))
                del self.index[evicted[-1][1]]
            self.ref[block] = 1
            self.n_referenced += 1
            blocks.append(block)
        return blocks, evicted

    def publish(self, block: int, h: bytes) -> None:
        """The block holds the computed K/V of prefix hash h: cache it (unless another block does)."""
        if h not in self.index and block not in self.hash_of:
            self.index[h] = block
            self.hash_of[block] = h


class KVAllocationError(RuntimeError):
    pass
