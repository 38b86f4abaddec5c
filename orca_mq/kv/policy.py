"""FastServe's KV cache manager, scheduler side: which jobs keep their KV on the device, which on the host.

A job runs only while it is *resident*: its KV on the device and its whole KV (prompt + max_tokens)
reserved there, as ORCA reserves it, so growing never fails and the resident jobs never outgrow the
device pool. Preemptive MLFQ leaves started jobs idle, each holding KV; three policies
(`fastserve.kv_policy`) decide what a job that is not resident does:

* `defer`: no swapping. A new job starts once its reservation fits next to the resident jobs'; it
  waits for free room meanwhile (the MLFQ then degrades to FCFS for the jobs waiting to start).
* `reactive`: a new job that needs room takes it from idle resident jobs of lower priority expected
  to need more than `fastserve.preempt_margin` (2) times its service, largest ENST first: their KV goes to the host pool and their
  reservation is released. A job whose KV is on the host waits for room (it takes none from others)
  and is uploaded in the iteration that runs it (which waits for the copy).
* `proactive` (FastServe): as reactive, and ahead of time: keep max(K, burst) blocks unreserved for
  arrivals by offloading the idle jobs with the largest ENST (among those expected to need more than
  a new job), and upload the smallest-ENST jobs on the host before they are scheduled, so the copies
  overlap the iterations in flight.

Residency keeps swapping from thrashing: a policy that started every job the host could back (the
earlier design) left more started jobs than the device could run, swapped them in and out every few
iterations and served them all slowly: 1.7x ORCA's mean JCT on the ORCA trace at 2x its capacity.
And a started job is preempted for another only when it is expected to need more service than that
one (sched/lengths.py learns the law of output lengths): that is when preemption shortens mean JCT
(heavy-tailed lengths, FastServe's traces), and it never is with light-tailed ones (ORCA's trace),
where preempting only made both jobs finish later (2x ORCA's mean JCT with 4096 device slots).
Measured with tools/simulate.py; BENCHMARKS.md.

The scheduler chooses the batch in priority order (sched/fastserve.py) and asks the policy to make
each job in it resident (`admit`); the policies decide; the block manager (block_manager.py) moves
blocks between its tiers and collects the plan's copies, which every stage applies before computing
(swapper.py). A job offloaded by a plan waits for a later one. Nothing is ever lost: a job is
offloaded only where the host pool has room for it, and a job on the host is uploaded before it runs.

With prefix caching a new job starts with the cached head of its prompt (held while it is
considered, so no offload frees it) and reserves only the blocks it does not share; an offload
frees only the blocks no other job holds: preemption never frees a block another job reads.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from orca_mq.kv.block_manager import BlockManager, Match
from orca_mq.kv.request import KVRequest


class Remaining(Protocol):
    """Expected remaining service in seconds (FastServe's scheduler: sched/lengths.py)."""

    def remaining_s(self, req: KVRequest) -> float: ...

    def new_job_s(self) -> float: ...


class DeferKV:
    def __init__(self, bm: BlockManager, expect: Remaining, margin: float) -> None:
        self.bm, self.expect, self.margin = bm, expect, margin
        self._evicted: set[str] = set()   # jobs the plan being built offloads: they wait for a later one

    @property
    def room(self) -> int:
        """Device blocks no resident job has reserved."""
        return self.bm.num_blocks - self.bm.n_rsrv

    def resident(self, req: KVRequest) -> bool:
        return req.reserved_blocks > 0

    def on_host(self, req: KVRequest) -> bool:
        return self.bm.on_host(req.request_id)

    def waits(self, req: KVRequest) -> bool:
        """Offloaded by the plan being built: it may run in a later one."""
        return req.request_id in self._evicted

    def admit(self, req: KVRequest, lower: Sequence[KVRequest], taken: set[str], enst: dict[str, float]) -> bool:
        """Make a job that is not resident resident for the plan being built: a new one starts (with
        its cached prefix, held while it is considered: a block it shares counts once, and no offload
        frees it meanwhile), one on the host is uploaded. A new one that needs room may take it from
        idle jobs among `lower` (make_room); False: it waits for room."""
        bm = self.bm
        new = not bm.on_host(req.request_id)
        size = bm.blocks_for(req.max_total_tokens)
        m = bm.match(req) if new else Match()
        bm.hold(m)
        need = size - m.n_device
        if need > self.room and not (new and self.make_room(need, req, lower, taken, enst)):
            bm.let_go(m)
            return False
        if new:
            bm.start(req, m, size)
        else:
            self.upload(req)
        return True

    def make_room(self, size: int, job: KVRequest, lower: Sequence[KVRequest], taken: set[str],
                  enst: dict[str, float]) -> bool:
        """Free `size` unreserved device blocks for `job` by offloading idle jobs among `lower` (priority)."""
        return False

    def ahead_of_time(self, order: Sequence[KVRequest], taken: set[str], enst: dict[str, float], reserve: int) -> None:
        """After the batch is chosen (a plan carries the swaps): offloads and uploads ahead of time."""

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The swap lists of the plan being sent; offloaded jobs may run again in later plans."""
        self._evicted = set()
        return self.bm.take_swaps()

    def offload(self, req: KVRequest) -> None:
        """Its KV to the host, its reservation released: it is no longer resident. (A job that was
        made resident but has written no KV yet only gives its reservation back.)"""
        self.bm.unreserve(req)
        self._evicted.add(req.request_id)
        if self.bm.table(req.request_id):
            req.swaps.offloads += 1
            req.swaps.offload_blocks += self.bm.offload(req.request_id)

    def upload(self, req: KVRequest) -> None:
        """Its KV back to the device, its whole KV reserved again: resident."""
        self.bm.reserve(req, self.bm.blocks_for(req.max_total_tokens))
        n = self.bm.upload(req.request_id)
        req.swaps.uploads += 1
        req.swaps.upload_blocks += n


class ReactiveKV(DeferKV):
    def victims(self, jobs: Sequence[KVRequest], taken: set[str], enst: dict[str, float], than: float) -> list[KVRequest]:
        """Idle resident jobs among `jobs`, not in this batch, expected to need `margin` times more
        service than `than` seconds (preempting one that is likely closer to its end only delays both,
        and a small gain does not pay for the copies and the churn), largest ENST first."""
        idle = [(enst[r.request_id], i) for i, r in enumerate(jobs) if r.request_id not in taken
                and self.resident(r) and self.bm.movable(r.request_id) and self.expect.remaining_s(r) > self.margin * than]
        return [jobs[i] for _, i in sorted(idle, reverse=True)]

    def make_room(self, size: int, job: KVRequest, lower: Sequence[KVRequest], taken: set[str],
                  enst: dict[str, float]) -> bool:
        """Offload victims until `size` blocks are unreserved; none if that cannot be reached."""
        chosen, room, host_free = [], self.room, self.bm.num_free_host_blocks
        for victim in self.victims(lower, taken, enst, self.expect.remaining_s(job)):
            if room >= size:
                break
            rid = victim.request_id
            n = self.bm.held(rid)
            if n <= host_free:   # its blocks other jobs hold stay reserved for them
                chosen.append(victim)
                room, host_free = room + victim.reserved_blocks - n + self.bm.freed_by_offload(rid), host_free - n
        if room < size:
            return False
        for victim in chosen:
            self.offload(victim)
        return True


class ProactiveKV(ReactiveKV):
    def ahead_of_time(self, order: Sequence[KVRequest], taken: set[str], enst: dict[str, float], reserve: int) -> None:
        bm = self.bm
        for victim in self.victims(order, taken, enst, self.expect.new_job_s()):
            if self.room >= reserve:
                break
            if bm.held(victim.request_id) <= bm.num_free_host_blocks:
                self.offload(victim)
        for _, i in sorted((enst[r.request_id], i) for i, r in enumerate(order) if bm.on_host(r.request_id)):
            job = order[i]
            if job.request_id in self._evicted:
                continue
            if self.room - bm.blocks_for(job.max_total_tokens) < reserve:
                break
            self.upload(job)


KV_POLICIES: dict[str, type[DeferKV]] = {"defer": DeferKV, "reactive": ReactiveKV, "proactive": ProactiveKV}
