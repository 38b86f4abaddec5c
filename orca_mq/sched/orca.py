"""ORCA Algorithm 1: iteration-level FCFS with `n_rsrv` KV reservation at a request's first schedule."""
from __future__ import annotations

from collections.abc import Iterable

from orca_mq.sched.base import Scheduler
from orca_mq.sched.registry import register
from orca_mq.sched.request import Phase, Request


@register("orca")
class OrcaScheduler(Scheduler):
    """ORCA Algorithm 1: iteration-level FCFS, reserving the KV blocks of max_tokens at a request's
    first schedule (`n_rsrv`, kept in blocks by the block manager)."""

    plans_ahead = True

    def select(self, now: float) -> list[Request]:
        return self.reserve_in_order(self.pool.values(), strict=True)   # arrival order

    def reserve_in_order(self, order: Iterable[Request], strict: bool) -> list[Request]:
        """Up to max_bs idle requests in `order`, each new one reserving its max_tokens (n_rsrv) first.
        One that does not fit stops the batch when `strict` (FCFS: a later request may not pass it),
        else is passed over."""
        bm = self.block_manager
        batch: list[Request] = []
        for req in order:
            if not self.selectable(req):
                continue
            if len(batch) == self.max_bs:
                break
            if req.phase is Phase.INITIATION and not req.reserved_blocks:
                blocks, cached = bm.blocks_for(req.max_total_tokens), bm.match(req)
                bm.hold(cached)
                if bm.n_rsrv_after(cached, blocks) > bm.num_blocks:   # a block it shares counts once
                    bm.let_go(cached)
                    if strict:
                        break
                    continue
                bm.start(req, cached, blocks)
            batch.append(req)
        return batch
