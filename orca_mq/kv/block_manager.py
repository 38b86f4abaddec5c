"""The scheduler side of the KV manager: which blocks of the device and host pools each request
holds, the blocks reserved for requests that started (ORCA's `n_rsrv`, FastServe's admission),
and the copies between the tiers that the next plan carries.

Allocation failure raises `KVAllocationError`; ORCA's reservation guarantees it never happens
under that policy, and FastServe's KV policies offload before it can.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orca_mq.kv.pool import PoolSize

if TYPE_CHECKING:
    from orca_mq.sched.request import Request


class KVAllocationError(RuntimeError):
    pass


@dataclass(slots=True)
class Tier:
    """One memory's blocks: which are free, which request holds which."""
    num_blocks: int
    free: deque[int] = field(init=False)
    tables: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = deque(range(self.num_blocks))

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise KVAllocationError(f"needs {n} KV blocks, {len(self.free)} free")
        return [self.free.popleft() for _ in range(n)]


class BlockManager:
    def __init__(self, size: PoolSize) -> None:
        self.size = size
        self.block_size = size.block_size
        self.device = Tier(size.device_blocks)
        self.host = Tier(size.host_blocks)
        self.n_rsrv = 0                               # blocks reserved by the requests that started
        self.swap_out: list[tuple[int, int]] = []     # (device, host) copies the next plan carries
        self.swap_in: list[tuple[int, int]] = []      # (host, device)
        self._read: list[int] = []                    # host blocks the next plan's uploads read: free once it is sent

    # ------------------------------------------------------------ sizes

    def blocks_for(self, n_tokens: int) -> int:
        return self.size.blocks_for(n_tokens)

    @property
    def num_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.device.free)

    @property
    def num_free_slots(self) -> int:
        return self.num_free_blocks * self.block_size

    @property
    def num_used_slots(self) -> int:
        return (self.num_blocks - self.num_free_blocks) * self.block_size

    @property
    def num_host_blocks(self) -> int:
        return self.host.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.host.free)

    # ------------------------------------------------------------ tables

    def table(self, request_id: str) -> list[int]:
        """Its device blocks ([] when it holds none there)."""
        return self.device.tables.get(request_id, [])

    def on_host(self, request_id: str) -> bool:
        return request_id in self.host.tables

    def held(self, request_id: str) -> int:
        """Blocks it holds, on whichever tier."""
        return len(self.device.tables.get(request_id, ())) or len(self.host.tables.get(request_id, ()))

    def ensure(self, request_id: str, n_tokens: int) -> list[int]:
        """Grow its device block table to hold n_tokens tokens; returns the table."""
        table = self.device.tables.get(request_id, [])
        missing = self.blocks_for(n_tokens) - len(table)
        if missing > self.num_free_blocks:
            raise KVAllocationError(
                f"request {request_id}: needs {missing} more KV blocks, {self.num_free_blocks} free"
            )
        self.device.tables[request_id] = table
        table.extend(self.device.take(max(0, missing)))
        return table

    def reserve(self, req: "Request", blocks: int) -> None:
        """The request starts: `blocks` count against the pool until it leaves."""
        req.reserved_blocks = blocks
        self.n_rsrv += blocks

    def unreserve(self, req: "Request") -> None:
        """Its reservation returns to the pool: its KV went to the host tier (FastServe's offload)."""
        self.n_rsrv -= req.reserved_blocks
        req.reserved_blocks = 0

    def release(self, req: "Request") -> None:
        """The request left: its blocks on both tiers and its reservation return to the pool."""
        self.n_rsrv -= req.reserved_blocks
        for tier in (self.device, self.host):
            tier.free.extend(tier.tables.pop(req.request_id, ()))

    # ------------------------------------------------------------ tiers

    def offload(self, request_id: str) -> int:
        """Move its KV to the host pool (copied by the next plan); returns the blocks moved."""
        blocks = self.device.tables[request_id]
        host_blocks = self.host.take(len(blocks))
        del self.device.tables[request_id]
        self.device.free.extend(blocks)
        self.host.tables[request_id] = host_blocks
        self.swap_out.extend(zip(blocks, host_blocks))
        return len(blocks)

    def upload(self, request_id: str) -> int:
        """Move its KV back to the device pool (copied by the next plan); returns the blocks moved."""
        host_blocks = self.host.tables[request_id]
        blocks = self.device.take(len(host_blocks))
        del self.host.tables[request_id]
        self.device.tables[request_id] = blocks
        self.swap_in.extend(zip(host_blocks, blocks))
        self._read.extend(host_blocks)
        return len(blocks)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies of the plan being sent. Every stage applies its offloads before its uploads, so
        a device block freed by an offload may receive an upload of the same plan; the host blocks
        it uploads from become free only now, for later plans."""
        out, self.swap_out, self.swap_in = (self.swap_out, self.swap_in), [], []
        self.host.free.extend(self._read)
        self._read = []
        return out

    # ------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        return {"n_slots": self.num_blocks * self.block_size, "free_slots": self.num_free_slots,
                "used_slots": self.num_used_slots, "reserved_slots": self.n_rsrv * self.block_size}

    def host_stats(self) -> dict[str, Any]:
        free = self.num_free_host_blocks * self.block_size
        slots = self.num_host_blocks * self.block_size
        return {"host_slots": slots, "host_free_slots": free, "host_used_slots": slots - free,
                "on_host": len(self.host.tables)}
