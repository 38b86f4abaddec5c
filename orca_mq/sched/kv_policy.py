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

The decisions become the plan's swap lists (`take_swaps`); every stage copies swap_out first,
then swap_in, then computes (workers/kv_swap.py). Hence within one plan a device block freed by an
offload may receive an upload, but a host block read by an upload is only reused by a later plan.

Nothing is ever lost: the host pool is the backing store. With swapping, a job starts only while
every started job's maximum KV would fit in the host pool (or all of them in the device pool), so
an offload always finds room. When the host pool is full, new jobs wait to start; a job that cannot
get device blocks in one iteration simply waits for a later one.
"""
from __future__ import annotations

from orca_mq.sched.block_manager import BlockManager
from orca_mq.sched.request import Request


class DeferKV:
    def __init__(self, device: BlockManager, host: BlockManager, max_bs: int) -> None:
        self.device, self.host, self.max_bs = device, host, max_bs
        self.n_reserved = 0                     # blocks of every started job's maximum KV (req.reserved_blocks)
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self._read: list[int] = []              # host blocks this plan's uploads read: free once it is sent
        self._evicted: set[str] = set()         # jobs this plan offloads: they wait for a later one
        self._promised = 0                      # free device blocks the batch being selected may grow into

    @property
    def capacity(self) -> int:
        """Blocks all started jobs may need at most, together."""
        return self.device.num_blocks

    @property
    def free(self) -> int:
        """Free device blocks not promised to the batch being selected."""
        return self.device.num_free_blocks - self._promised

    def select(self, order: list[Request], enst: dict[str, float], reserve: int,
               max_prompt_tokens: int | None = None) -> list[Request]:
        """The batch: jobs in priority order, up to max_bs, each with its KV on the device for this
        iteration (uploaded by this plan if need be) and room for its new tokens (at most
        `max_prompt_tokens` of a prompt: a chunk of it under a token budget)."""
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
            size = self.device.blocks_for(req.max_total_tokens)
            if new and (not admitting or self.n_reserved + size > self.capacity):
                admitting = False  # no later job starts before this one: big jobs are not starved by small ones
                continue
            tokens, start = req.next_tokens(max_prompt_tokens)
            held = len(self.device.table(rid)) or len(self.host.tables.get(rid, ()))
            grow = max(0, self.device.blocks_for(start + len(tokens)) - held)
            need = grow + (held if rid in self.host.tables else 0)   # an upload takes its blocks now
            taken.add(rid)  # from here on, not a victim
            if need > self.free and not self.make_room(need, order, taken, enst):
                taken.discard(rid)
                continue
            if rid in self.host.tables:
                self.upload(req)
            self._promised += grow
            if new:
                self.reserve(req, size)
            batch.append(req)
        if batch:  # swaps ride on a plan: none without one
            self.ahead_of_time(order, taken, enst, reserve)
        return batch

    def reserve(self, req: Request, blocks: int) -> None:
        """The job starts: its maximum KV counts against `capacity` until it leaves."""
        req.reserved_blocks = blocks
        self.n_reserved += blocks

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

    def offload(self, req: Request) -> None:
        blocks = self.device.free(req.request_id)
        host_blocks = self.host.take(len(blocks))
        self.host.assign(req.request_id, host_blocks)
        self.swap_out.extend(zip(blocks, host_blocks))
        self._evicted.add(req.request_id)
        req.swaps.offloads += 1
        req.swaps.offload_blocks += len(blocks)

    def upload(self, req: Request) -> None:
        host_blocks = self.host.tables.pop(req.request_id)
        blocks = self.device.take(len(host_blocks))
        self.device.assign(req.request_id, blocks)
        self.swap_in.extend(zip(host_blocks, blocks))
        self._read.extend(host_blocks)
        req.swaps.uploads += 1
        req.swaps.upload_blocks += len(blocks)

    def release(self, req: Request) -> None:
        """A job left: its host blocks return to the pool (the scheduler frees its device blocks)."""
        self.n_reserved -= req.reserved_blocks
        self.host.free(req.request_id)

    def on_host(self, rid: str) -> bool:
        return rid in self.host.tables


class ReactiveKV(DeferKV):
    @property
    def capacity(self) -> int:
        return max(self.device.num_blocks, self.host.num_blocks)

    def victims(self, order: list[Request], taken: set[str], enst: dict[str, float]) -> list[Request]:
        """Idle jobs with KV on the device, not in this batch, largest ENST (then lowest priority) first."""
        idle = [(enst[r.request_id], i) for i, r in enumerate(order)
                if r.request_id not in taken and self.device.table(r.request_id)]
        return [order[i] for _, i in sorted(idle, reverse=True)]

    def make_room(self, need: int, order: list[Request], taken: set[str], enst: dict[str, float]) -> bool:
        """Offload victims until `need` device blocks are free; none if that cannot be reached."""
        chosen, free, host_free = [], self.free, self.host.num_free_blocks
        for victim in self.victims(order, taken, enst):
            if free >= need:
                break
            n = len(self.device.table(victim.request_id))
            if n <= host_free:
                chosen.append(victim)
                free, host_free = free + n, host_free - n
        if free < need:
            return False
        for victim in chosen:
            self.offload(victim)
        return True


class ProactiveKV(ReactiveKV):
    def ahead_of_time(self, order: list[Request], taken: set[str], enst: dict[str, float], reserve: int) -> None:
        for victim in self.victims(order, taken, enst):
            if self.free >= reserve:
                break
            if len(self.device.table(victim.request_id)) <= self.host.num_free_blocks:
                self.offload(victim)
        # upload only with a batch's growth (a block per job) to spare, so the job is not the next victim
        waiting = sorted((enst[r.request_id], i) for i, r in enumerate(order) if r.request_id in self.host.tables)
        for _, i in waiting:
            if self.free - len(self.host.tables[order[i].request_id]) < reserve + self.max_bs:
                break
            self.upload(order[i])


KV_POLICIES: dict[str, type[DeferKV]] = {"defer": DeferKV, "reactive": ReactiveKV, "proactive": ProactiveKV}
