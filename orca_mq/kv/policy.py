"""FastServe's KV cache manager, scheduler side: which jobs keep their KV on the device, which on the host.

Preemptive MLFQ leaves many jobs started but not running, each holding KV, so the device pool
can fill. Three policies (`fastserve.kv_policy`) decide what happens then:

* `defer`: no swapping. A job starts only when its whole KV (prompt + max_tokens) fits in the
  device pool next to every started job's, so new jobs wait for free blocks (MLFQ degrades to FCFS).
* `reactive`: offload jobs, largest ENST first, only when an allocation of the batch fails; upload
  a job's KV in the very iteration that runs it (that iteration waits for the copy).
* `proactive` (FastServe): as reactive, and also keep max(K, burst) blocks free for arrivals by
  offloading ahead of time, and upload the smallest-ENST job before it is scheduled, so the copy
  overlaps with the iteration in flight.

`select` only promises a job the blocks its new tokens may need (at most the budget's chunk) and
leaves free, uploaded or not; the scheduler allocates for the chunk the token budget actually
gives (`Scheduler.fit_budget` may give less), so no block is taken, or offloaded, unwritten.

The policies decide; the block manager (block_manager.py) moves blocks between its tiers and
collects the plan's copies, which every stage applies before computing (swapper.py).

Nothing is ever lost: the host pool is the backing store. With swapping, a job starts only while
every started job's maximum KV would fit in the host pool (or all of them in the device pool), so
an offload always finds room. When the host pool is full, new jobs wait to start; a job that cannot
get device blocks in one iteration simply waits for a later one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from orca_mq.kv.block_manager import BlockManager

if TYPE_CHECKING:
    from orca_mq.sched.request import Request


class DeferKV:
    def __init__(self, bm: BlockManager, max_bs: int) -> None:
        self.bm, self.max_bs = bm, max_bs
        self._evicted: set[str] = set()         # jobs the plan being built offloads: they wait for a later one
        self._promised = 0                      # free device blocks the batch being selected may grow into

    @property
    def capacity(self) -> int:
        """Blocks all started jobs may need at most, together (their reservations)."""
        return self.bm.num_blocks

    @property
    def free(self) -> int:
        """Free device blocks not promised to the batch being selected."""
        return self.bm.num_free_blocks - self._promised

    def select(self, order: list["Request"], enst: dict[str, float], reserve: int,
               max_prompt_tokens: int | None = None) -> list["Request"]:
        """The batch: jobs in priority order, up to max_bs, each with its KV on the device for this
        iteration (uploaded by this plan if need be) and room for its new tokens (at most
        `max_prompt_tokens` of a prompt: a chunk of it under a token budget)."""
        bm = self.bm
        batch: list[Request] = []
        taken: set[str] = set()
        admitting = True
        self._promised = 0   # the previous batch's blocks are allocated by now
        for req in order:
            if len(batch) == self.max_bs:
                break
            rid = req.request_id
            if rid in self._evicted:
                continue
            new = not req.reserved_blocks
            size = bm.blocks_for(req.max_total_tokens)
            if new and (not admitting or bm.n_rsrv + size > self.capacity):
                admitting = False  # no later job starts before this one: big jobs are not starved by small ones
                continue
            tokens, start = req.next_tokens(max_prompt_tokens)
            held = bm.held(rid)
            grow = max(0, bm.blocks_for(start + len(tokens)) - held)
            need = grow + (held if bm.on_host(rid) else 0)   # an upload takes its blocks now
            taken.add(rid)  # from here on, not a victim
            if need > self.free and not self.make_room(need, order, taken, enst):
                taken.discard(rid)
                continue
            if bm.on_host(rid):
                self.upload(req)
            self._promised += grow
            if new:
                bm.reserve(req, size)
            batch.append(req)
        if batch:  # swaps ride on a plan: none without one
            self.ahead_of_time(order, taken, enst, reserve)
        return batch

    def make_room(self, need: int, order: list["Request"], taken: set[str], enst: dict[str, float]) -> bool:
        return False

    def ahead_of_time(self, order: list["Request"], taken: set[str], enst: dict[str, float], reserve: int) -> None:
        pass

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The swap lists of the plan being sent; offloaded jobs may run again in later plans."""
        self._evicted = set()
        return self.bm.take_swaps()

    def offload(self, req: "Request") -> None:
        n = self.bm.offload(req.request_id)
        self._evicted.add(req.request_id)
        req.swaps.offloads += 1
        req.swaps.offload_blocks += n

    def upload(self, req: "Request") -> None:
        n = self.bm.upload(req.request_id)
        req.swaps.uploads += 1
        req.swaps.upload_blocks += n


class ReactiveKV(DeferKV):
    @property
    def capacity(self) -> int:
        return max(self.bm.num_blocks, self.bm.num_host_blocks)

    def victims(self, order: list["Request"], taken: set[str], enst: dict[str, float]) -> list["Request"]:
        """Idle jobs with KV on the device, not in this batch, largest ENST (then lowest priority) first."""
        idle = [(enst[r.request_id], i) for i, r in enumerate(order)
                if r.request_id not in taken and self.bm.table(r.request_id)]
        return [order[i] for _, i in sorted(idle, reverse=True)]

    def make_room(self, need: int, order: list["Request"], taken: set[str], enst: dict[str, float]) -> bool:
        """Offload victims until `need` device blocks are free; none if that cannot be reached."""
        chosen, free, host_free = [], self.free, self.bm.num_free_host_blocks
        for victim in self.victims(order, taken, enst):
            if free >= need:
                break
            n = len(self.bm.table(victim.request_id))
            if n <= host_free:
                chosen.append(victim)
                free, host_free = free + n, host_free - n
        if free < need:
            return False
        for victim in chosen:
            self.offload(victim)
        return True


class ProactiveKV(ReactiveKV):
    def ahead_of_time(self, order: list["Request"], taken: set[str], enst: dict[str, float], reserve: int) -> None:
        bm = self.bm
        for victim in self.victims(order, taken, enst):
            if self.free >= reserve:
                break
            if len(bm.table(victim.request_id)) <= bm.num_free_host_blocks:
                self.offload(victim)
        # upload only with a batch's growth (a block per job) to spare, so the job is not the next victim
        waiting = sorted((enst[r.request_id], i) for i, r in enumerate(order) if bm.on_host(r.request_id))
        for _, i in waiting:
            if self.free - bm.held(order[i].request_id) < reserve + self.max_bs:
                break
            self.upload(order[i])


KV_POLICIES: dict[str, type[DeferKV]] = {"defer": DeferKV, "reactive": ReactiveKV, "proactive": ProactiveKV}
