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
collects the plan's copies, which every stage applies before computing (swapper.py). With prefix
caching a new job starts with the cached head of its prompt (held while it is considered, so no
offload frees it), and an offload frees only the blocks no other job holds: preemption never
frees a block another job reads.

Nothing is ever lost: the host pool is the backing store. With swapping, a job starts only while
every started job's maximum KV would fit in the host pool (or all of them in the device pool), so
an offload always finds room. When the host pool is full, new jobs wait to start; a job that cannot
get device blocks in one iteration simply waits for a later one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from orca_mq.kv.block_manager import BlockManager, Match

if TYPE_CHECKING:
    from orca_mq.sched.request import Request


class DeferKV:
    def __init__(self, bm: BlockManager, max_bs: int) -> None:
        self.bm, self.max_bs = bm, max_bs
        self._promised = 0                      # free device blocks the batch being selected may grow into

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
            if bm.on_host(rid) and not bm.movable(rid):
                continue   # offloaded by the plan being built: it waits for a later one
            m: Match | None = None
            if not req.reserved_blocks:   # a new job: its cached prefix is held while it is considered
                if not admitting:
                    continue
                m, size = bm.match(req), bm.blocks_for(req.max_total_tokens)
                bm.hold(m)
                if not self.admits(m, size):
                    bm.let_go(m)
                    admitting = False  # no later job starts before this one: big jobs are not starved by small ones
                    continue
                held, end = len(m.hits), len(req.prompt_token_ids)
                if max_prompt_tokens is not None:
                    end = min(end, held * bm.block_size + max_prompt_tokens)
                need = m.n_host                      # its host hits are uploaded now
            else:
                tokens, start = req.next_tokens(max_prompt_tokens)
                held, end = bm.held(rid), start + len(tokens)
                need = held if bm.on_host(rid) else 0   # an upload takes its blocks now
            grow = max(0, bm.blocks_for(end) - held)
            need += grow
            taken.add(rid)  # from here on, not a victim
            if need > self.free and not self.make_room(need, order, taken, enst):
                taken.discard(rid)
                if m is not None:
                    bm.let_go(m)
                continue
            if m is not None:
                bm.start(req, m, size)
            elif bm.on_host(rid):
                self.upload(req)
            self._promised += grow
            batch.append(req)
        if batch:  # swaps ride on a plan: none without one
            self.ahead_of_time(order, taken, enst, reserve)
        return batch

    def admits(self, m: Match, size: int) -> bool:
        """Whether a new job of `size` blocks (less its held cached prefix) may start: every started
        job's KV fits the device pool together."""
        return self.bm.n_rsrv_after(m, size) <= self.bm.num_blocks

    def make_room(self, need: int, order: list["Request"], taken: set[str], enst: dict[str, float]) -> bool:
        return False

    def ahead_of_time(self, order: list["Request"], taken: set[str], enst: dict[str, float], reserve: int) -> None:
        pass

    def offload(self, req: "Request") -> None:
        n = self.bm.offload(req.request_id)
        req.swaps.offloads += 1
        req.swaps.offload_blocks += n

    def upload(self, req: "Request") -> None:
        n = self.bm.upload(req.request_id)
        req.swaps.uploads += 1
        req.swaps.upload_blocks += n


class ReactiveKV(DeferKV):
    def admits(self, m: Match, size: int) -> bool:
        """...or every started job's whole KV fits the host pool (an offload copies a job's shared
        blocks too), so an offload always finds room."""
        return super().admits(m, size) or self.bm.reserved_total + size <= self.bm.num_host_blocks

    def victims(self, order: list["Request"], taken: set[str], enst: dict[str, float]) -> list["Request"]:
        """Idle jobs with KV on the device, not in this batch nor uploaded by this plan, largest ENST
        (then lowest priority) first."""
        idle = [(enst[r.request_id], i) for i, r in enumerate(order)
                if r.request_id not in taken and self.bm.table(r.request_id) and self.bm.movable(r.request_id)]
        return [order[i] for _, i in sorted(idle, reverse=True)]

    def make_room(self, need: int, order: list["Request"], taken: set[str], enst: dict[str, float]) -> bool:
        """Offload victims until `need` device blocks are free; none if that cannot be reached."""
        bm = self.bm
        chosen, free, host_free = [], self.free, bm.num_free_host_blocks
        for victim in self.victims(order, taken, enst):
            if free >= need:
                break
            n = bm.held(victim.request_id)
            if n <= host_free:
                chosen.append(victim)
                free, host_free = free + bm.freed_by_offload(victim.request_id), host_free - n
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
            if bm.held(victim.request_id) <= bm.num_free_host_blocks:
                self.offload(victim)
        # upload only with a batch's growth (a block per job) to spare, so the job is not the next victim
        waiting = sorted((enst[r.request_id], i) for i, r in enumerate(order)
                         if bm.on_host(r.request_id) and bm.movable(r.request_id))
        for _, i in waiting:
            if self.free - bm.held(order[i].request_id) < reserve + self.max_bs:
                break
            self.upload(order[i])


KV_POLICIES: dict[str, type[DeferKV]] = {"defer": DeferKV, "reactive": ReactiveKV, "proactive": ProactiveKV}
