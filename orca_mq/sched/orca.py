"""ORCA Algorithm 1: iteration-level FCFS with `n_rsrv` KV reservation at a request's first schedule,
and each client's fair share of the pool (orca_mq.fair_share)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from orca_mq.fair_share import FairShare
from orca_mq.sched.base import Scheduler
from orca_mq.sched.registry import register
from orca_mq.sched.request import Phase, Request

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.engine.model_info import ModelInfo


def interleaved(reqs: Iterable[Request]) -> list[Request]:
    """Round robin across clients, each client's requests in arrival order: A1 B1 A2 B2 A3 (one
    client: arrival order). A client's place in the batch does not depend on how many it sent."""
    reqs = list(reqs)
    if len({r.client for r in reqs}) < 2:
        return reqs
    rank: Counter[str] = Counter()
    keyed = []
    for i, r in enumerate(reqs):
        keyed.append((rank[r.client], i, r))
        rank[r.client] += 1
    keyed.sort(key=lambda k: k[:2])
    return [r for *_, r in keyed]


@register("orca")
class OrcaScheduler(Scheduler):
    """ORCA Algorithm 1: iteration-level FCFS, reserving the KV blocks of max_tokens at a request's
    first schedule (`n_rsrv`, kept in blocks by the block manager). Across clients, round robin: each
    client's requests are FCFS among themselves, and a client's reservations stay within its fair
    share of the pool unless they leave server.client_headroom of it free, so no client can take the
    room another one needs to start (reservations stay whole: nothing is preempted, nothing deadlocks)."""

    plans_ahead = True

    def __init__(self, cfg: "Config", info: "ModelInfo") -> None:
        super().__init__(cfg, info)
        self.shares = FairShare.of(self.block_manager.num_blocks, cfg.server.client_headroom)
        self.order: tuple[int, list[Request]] = (0, [])   # (pool_changes, the pool interleaved then)
        self.unstarted: set[str] = set()   # requests in the pool that reserve_in_order has not started yet

    def enter(self, req: Request) -> None:
        self.unstarted.add(req.request_id)

    def release(self, req: Request) -> None:
        self.unstarted.discard(req.request_id)

    def select(self, now: float) -> list[Request]:
        if self.order[0] != self.pool_changes:   # the order changes only with the pool's members (a sort per iteration)
            self.order = (self.pool_changes, interleaved(self.pool.values()))
        if not self.in_flight and not self.unstarted:   # every request idle and started: its first max_bs, as below
            return self.order[1][:self.max_bs]
        return self.reserve_in_order(self.order[1], strict=True)

    def reserve_in_order(self, order: Iterable[Request], strict: bool) -> list[Request]:
        """Up to max_bs idle requests in `order`, each new one reserving its max_tokens (n_rsrv) first.
        One that does not fit the pool stops every later new one when `strict` (FCFS: a later request
        may not pass it; those already started still run, or a started one behind it in the clients'
        turns would wait for KV only it holds), else is passed over; one past its client's share is
        passed over, and with `strict` so are its client's later ones."""
        bm = self.block_manager
        held: Counter[str] | None = None   # blocks reserved, by client: counted when a request first needs them
        batch: list[Request] = []
        waiting: set[str] = set()   # clients whose earlier request waits for its share
        full = False                # a new request did not fit the pool (strict: no later one starts)
        started = len(self.pool) - len(self.unstarted)   # started requests not passed yet: none left ends a full pass
        for req in order:
            if full and not started:
                break
            new = req.phase is Phase.INITIATION and not req.reserved_blocks
            started -= not new
            if req.in_flight and not self.selectable(req):   # an idle request is selectable: spares the call
                continue
            if len(batch) == self.max_bs:
                break
            if new:
                if full or req.client in waiting:
                    continue
                if held is None:
                    held = Counter()
                    for r in self.pool.values():
                        if r.reserved_blocks:
                            held[r.client] += r.reserved_blocks
                blocks, cached = bm.blocks_for(req.max_total_tokens), bm.match(req)
                bm.hold(cached)
                after = bm.n_rsrv_after(cached, blocks)
                if after > bm.num_blocks:   # a block it shares counts once
                    bm.let_go(cached)
                    full = strict
                    continue
                if not self.shares.allows(held[req.client], bm.n_rsrv, after - bm.n_rsrv, len(held) + (req.client not in held)):
                    bm.let_go(cached)
                    if strict:
                        waiting.add(req.client)
                    continue
                bm.start(req, cached, blocks)
                self.unstarted.discard(req.request_id)
                held[req.client] += blocks
            batch.append(req)
        return batch
