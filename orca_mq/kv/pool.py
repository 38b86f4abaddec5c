"""The KV pool's size, in blocks: one object built from the config for everyone who needs it
(the scheduler's block manager, each stage's KV tensors and host pool, request validation, the
HTTP API's default max_tokens), so none of them can disagree on it. Where the workers size it from
their device's memory (kv/sizing.py) the launcher puts their figure in the others' config first."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orca_mq.runtime.device import uses_cuda

if TYPE_CHECKING:
    from orca_mq.config import Config

AUTO_CPU_SLOTS = 16384   # engine.n_slots = 0 where the pool is not sized from a device's memory (the CPU)
FAKE_ENV = "ORCA_MQ_FAKE_DEVICE_MEMORY"   # kv/sizing.py: a device of a fixed size, for tests on the CPU


def sized_at_start(cfg: "Config") -> bool:
    """Whether the workers size the KV pool from their device's memory (the others learn it from them)."""
    return cfg.engine.n_slots == 0 and (FAKE_ENV in os.environ or uses_cuda(cfg.engine.device))


@dataclass(frozen=True, slots=True)
class PoolSize:
    block_size: int       # tokens per block: the unit of allocation, reservation, offload, upload and sharing
    device_blocks: int    # blocks in each stage's device pool (engine.n_slots // block_size)
    host_blocks: int      # blocks in each stage's host pool, FastServe's offload target (may be 0: no offload)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.device_blocks < 1 or self.host_blocks < 0:
            raise ValueError(f"KV pool needs >= 1 device block of >= 1 slot (engine.n_slots >= engine.block_size), "
                             f"got {self.device_blocks} x {self.block_size}, {self.host_blocks} host blocks")

    @classmethod
    def from_config(cls, cfg: "Config") -> "PoolSize":
        eng = cfg.engine
        if eng.block_size < 1:
            raise ValueError(f"engine.block_size must be >= 1, got {eng.block_size}")
        slots = eng.n_slots
        if not slots:
            if sized_at_start(cfg):
                raise ValueError("engine.n_slots = 0: the workers size the KV pool from their device's memory, and this "
                                 "process was started without their figure")
            slots = AUTO_CPU_SLOTS
        return cls(eng.block_size, slots // eng.block_size, eng.host_slots // eng.block_size)

    @property
    def device_slots(self) -> int:
        """Tokens the device pool holds (whole blocks only)."""
        return self.device_blocks * self.block_size

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def fits(self, n_tokens: int) -> bool:
        """Whether one request of n_tokens tokens can ever hold its KV in the device pool."""
        return self.blocks_for(n_tokens) <= self.device_blocks
