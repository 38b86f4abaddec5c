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

The decisions become the plan's swap lists (`take_swaps`); every stage copies swap_out first,
then swap_in, then computes (workers/kv_swap.py). Hence within one plan a device block freed by an
offload may receive an upload, but a host block read by an upload is only reused by a later plan.

Nothing is ever lost: the host pool is the backing store. With swapping, a job starts only while
every started job's maximum KV would fit in the host pool (or all of them in the device pool), so
an offload always finds room. When the host pool is full, new jobs wait to start; a job that cannot
get device blocks in one iteration simply waits for a later one.
"""
from __future__ import annotations

from dataclasses import dataclass

from orca_mq.sched.block_manager import BlockManager
from orca_mq.sched.request import Request


@dataclass(slots=True)
class SwapCounts:
    offloads: int = 0
    uploads: int = 0
    offload_blocks: int = 0
    upload_blocks: int = 0


class DeferKV:
    def __init__(self, device: BlockManager, host: BlockManager, max_bs: int) -> None:
        self.device, self.host, self.max_bs = device, host, max_bs
        self.reserved: dict[str, int] = {}      # started jobs -> blocks of their maximum KV
        self.counts: dict[str, SwapCounts] = {}
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self._read: list[int] = []              # host blocks this plan's uploads read: free once it is sent
        self._evicted: set[str] = set()         # jobs this plan offloads: they wait for a later one

    @property
    def capacity(self) -> int:
        """Blocks all started jobs may need at most, together."""
        return self.device.num_blocks

    def select(self, order: list[Request], enst: dict[str, float], reserve: int,
               max_prompt_tokens: int | None = None) -> list[Request]:
        """The batch: jobs in priority order, up to max_bs, each with its KV on the device for this
        iteration (uploaded by this plan if need be) and room for its new tokens (at most
        `max_prompt_tokens` of a prompt: a chunk of it under a token budget)."""
        batch: list[Request] = []
        taken: set[str] = set()
        admitting, n_reserved = True, sum(self.reserved.values())
        for req in order:
            if len(batch) == self.max_bs:
                break
            rid = req.req_id
            if rid in self._evicted:
                continue
            new = rid not in self.reserved
            size = self.device.blocks_for(req.max_total_tokens)
            if new and (not admitting or n_reserved + size > self.capacity):
                admitting = False  # no later job starts before this one: big jobs are not starved by small ones
                continue
            tokens, start = req.next_tokens(max_prompt_tokens)
            need = self.device.blocks_for(start + len(tokens)) - len(self.device.table(rid))
            taken.add(rid)  # from here on, not a victim
            if need > self.device.num_free_blocks and not self.make_room(need, order, taken, enst):
                taken.discard(rid)
                continue
            if rid in self.host.tables:
                self.upload(rid)
            self.device.ensure(rid, start + len(tokens))
            if new:
                self.reserved[rid] = size
                n_reserved += size
            batch.append(req)
        if batch:  # swaps ride on a plan: none without one
            self.ahead_of_time(order, taken, enst, reserve)
        return batch

    def make_room(self, need: int, order: list[Request], taken: set[str], enst: dict[str, float]) -> bool:
        return False

    def ahead_of_time(self, order: list[Request], taken: set[str], enst: dict[str, float], reserve: int) -> None:
        pass

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The swap lists of the plan being sent; the host blocks it uploads from become free."""
        out, self.swap_out, self.swap_in = (self.swap_out, self.swap_in), [], []
        self.host.free_blocks.extend(self._read)
        self._read, self._evicted = [], set()
        return out

    def offload(self, rid: str) -> None:
        blocks = self.device.free(rid)
        host_blocks = self.host.take(len(blocks))
        self.host.assign(rid, host_blocks)
        self.swap_out.extend(zip(blocks, host_blocks))
        self._evicted.add(rid)
        c = self.counts.setdefault(rid, SwapCounts())
        c.offloads, c.offload_blocks = c.offloads + 1, c.offload_blocks + len(blocks)

    def upload(self, rid: str) -> None:
        host_blocks = self.host.tables.pop(rid)
        blocks = self.device.take(len(host_blocks))
        self.device.assign(rid, blocks)
        self.swap_in.extend(zip(host_blocks, blocks))
        self._read.extend(host_blocks)
        c = self.counts.setdefault(rid, SwapCounts())
        c.uploads, c.upload_blocks = c.uploads + 1, c.upload_blocks + len(blocks)

    def release(self, rid: str) -> SwapCounts:
        """A job left: its host blocks return to the pool (the scheduler frees its device blocks)."""
        self.reserved.pop(rid, None)
        self.host.free(rid)
        return self.counts.pop(rid, SwapCounts())

    def on_host(self, rid: str) -> bool:
        return rid in self.host.tables


class ReactiveKV(DeferKV):
    @property
    def capacity(self) -> int:
        return max(self.device.num_blocks, self.host.num_blocks)

    def victims(self, order: list[Request], taken: set[str], enst: dict[str, float]) -> list[str]:
        """Idle jobs with KV on the device, not in this batch, largest ENST (then lowest priority) first."""
        idle = [(enst[r.req_id], i, r.req_id) for i, r in enumerate(order)
                if r.req_id not in taken and self.device.table(r.req_id)]
        return [rid for _, _, rid in sorted(idle, reverse=True)]

    def make_room(self, need: int, order: list[Request], taken: set[str], enst: dict[str, float]) -> bool:
        """Offload victims until `need` device blocks are free; none if that cannot be reached."""
        chosen, free, host_free = [], self.device.num_free_blocks, self.host.num_free_blocks
        for rid in self.victims(order, taken, enst):
            if free >= need:
                break
            n = len(self.device.table(rid))
            if n <= host_free:
                chosen.append(rid)
                free, host_free = free + n, host_free - n
        if free < need:
            return False
        for rid in chosen:
            self.offload(rid)
        return True


class ProactiveKV(ReactiveKV):
    def ahead_of_time(self, order: list[Request], taken: set[str], enst: dict[str, float], reserve: int) -> None:
        for rid in self.victims(order, taken, enst):
            if self.device.num_free_blocks >= reserve:
                break
            if len(self.device.table(rid)) <= self.host.num_free_blocks:
                self.offload(rid)
        # upload only with a batch's growth (a block per job) to spare, so the job is not the next victim
        waiting = sorted((enst[r.req_id], i, r.req_id) for i, r in enumerate(order) if r.req_id in self.host.tables)
        for _, _, rid in waiting:
            if self.device.num_free_blocks - len(self.host.tables[rid]) < reserve + self.max_bs:
                break
            self.upload(rid)


KV_POLICIES: dict[str, type[DeferKV]] = {"defer": DeferKV, "reactive": ReactiveKV, "proactive": ProactiveKV}
