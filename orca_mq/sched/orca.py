"""ORCA Algorithm 1: iteration-level FCFS with `n_rsrv` KV reservation at a request's first schedule."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from orca_mq.sched.base import Scheduler
from orca_mq.sched.registry import register
from orca_mq.sched.request import Phase, Request

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.engine.model_info import ModelInfo


@register("orca")
class OrcaScheduler(Scheduler):
    """ORCA Algorithm 1: iteration-level FCFS, reserving max_tokens KV slots at a request's first schedule."""

    def __init__(self, cfg: "Config", info: "ModelInfo") -> None:
        super().__init__(cfg, info)
        self.n_slots = self.block_manager.num_blocks * self.block_manager.block_size
        self.n_rsrv = 0  # slots reserved by the requests in the pool

    def select(self, now: float) -> list[Request]:
        return self.reserve_in_order(self.pool.values(), strict=True)   # arrival order

    def reserve_in_order(self, order: Iterable[Request], strict: bool) -> list[Request]:
        """Up to max_bs idle requests in `order`, each new one reserving its max_tokens (n_rsrv) first.
        One that does not fit stops the batch when `strict` (FCFS: a later request may not pass it),
        else is passed over."""
        bm = self.block_manager
        batch: list[Request] = []
        for req in order:
            if req.running:
                continue
            if len(batch) == self.max_bs:
                break
            if req.phase is Phase.INITIATION and not req.reserved_blocks:
                blocks = bm.blocks_for(req.max_total_tokens)
                if self.n_rsrv + blocks * bm.block_size > self.n_slots:
                    if strict:
                        break
                    continue
                self.n_rsrv += blocks * bm.block_size
                req.reserved_blocks = blocks
            batch.append(req)
        return batch

    def release(self, req: Request) -> None:
        self.n_rsrv -= req.reserved_blocks * self.block_manager.block_size

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "reserved_slots": self.n_rsrv}
