"""Applies the plans' KV offloads (swap_out) and uploads (swap_in) on a stage: the one code path,
run on a copy thread beside the compute thread (workers) or inline before the compute (offline).

With a thread, the controller hands each plan over as its control frame arrives (`submit`), so the
copies start while the compute thread is still busy with earlier iterations; before computing a
plan, the compute thread waits (`wait`) only for what that plan touches: every earlier plan's
copies, and its own offloads of and uploads into blocks of its block tables (an offloaded block may
be reused at once). Proactive offloads and uploads of jobs that run later keep going meanwhile; the
next plan waits for them. After issuing a plan's compute it says so (`computed`).

Ordering, both ways. Copy -> compute: a plan's compute waits for its copies (CUDA: the compute
stream waits on the copy stream's event, not the host). Compute -> copy: a plan's swaps touch only
blocks that no plan in flight touches (the scheduler swaps idle jobs and free blocks only), i.e.
blocks last computed by plans whose results came back. With at most `depth` plans in flight
(engine.n_workers), the plan `depth` places before this one on this stage has come back, so the
copies wait for its compute (CUDA: the copy stream waits on its event, recorded when the compute
thread issued it) and never for the compute in flight: they overlap it.

One FIFO copy thread per stage keeps the scheduler's order: plan by plan, offloads before uploads (a
device block freed by an offload may receive an upload of the same plan; host blocks are never
reused within a plan). On CUDA the copies are asynchronous (`non_blocking`, pinned host blocks, the
copy thread's own stream); this path is correct by construction but has not run here (no GPU:
README Limits). On CPU they are plain copies.

A failed copy leaves the pools in an unknown state: every later wait raises `KVSwapFailed`, which
ends the worker (workers/stage_executor.py) so that the launcher restarts it.
"""
from __future__ import annotations

import queue
import threading
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from orca_mq.runtime.device import use_device
from orca_mq.runtime.threads import use_threads
from orca_mq.kv.cache import HostKV, KVCache
from orca_mq.protocol.iteration import PackedPlan


class KVSwapFailed(RuntimeError):
    """The copy thread failed: this stage can no longer compute correctly."""


@dataclass(slots=True)
class _Barrier:
    item: int                   # this many queued copy items must have landed...
    critical: bool              # ...the last one only up to its critical part (the plan's own)


class KVSwapper:
    def __init__(self, kv: KVCache, host_blocks: int, depth: int, threaded: bool = True) -> None:
        self.kv = kv
        self.host = HostKV.like(kv, host_blocks)
        self.depth = depth          # plans in flight at most: the one `depth` back has come back
        self.threaded = threaded
        self.stream = torch.cuda.Stream(kv.k.device) if threaded and kv.k.is_cuda else None
        self._items: queue.SimpleQueue[tuple[int, PackedPlan] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._barriers: dict[int, _Barrier] = {}
        self._plans = 0         # plans submitted (this stage's plan numbers: submit order = compute order)
        self._done = 0          # plans whose compute was issued
        self._queued = 0
        self._critical = 0      # items whose critical part landed
        self._landed = 0        # items wholly landed
        self._copy_events: dict[tuple[int, bool], torch.cuda.Event] = {}
        self._compute_events: dict[int, torch.cuda.Event] = {}
        self._error: BaseException | None = None
        self._closed = False
        if threaded:
            self._threads_set = threading.Event()
            self._thread = threading.Thread(target=self._run, name="kv-swap", daemon=True)
            self._thread.start()
            self._threads_set.wait()   # its use_threads(1) is done: the compute thread may now set its own last

    def submit(self, plan: PackedPlan) -> None:
        """Queue the plan's copies (idempotent). A plan without copies only waits for earlier ones."""
        if not self.threaded:
            return
        with self._cond:
            if plan.iteration in self._barriers:
                return
            self._plans += 1
            if plan.swap_out or plan.swap_in:
                self._queued += 1
                self._barriers[plan.iteration] = _Barrier(self._queued, True)
                self._items.put((self._plans, plan))
            else:
                self._barriers[plan.iteration] = _Barrier(self._queued, False)

    def wait(self, plan: PackedPlan) -> None:
        """Block the compute thread until the copies this plan reads have landed (inline: copy them)."""
        if not self.threaded:
            self._copy(plan, set())
            return
        self.submit(plan)
        with self._cond:
            b = self._barriers.pop(plan.iteration)
            self._cond.wait_for(lambda: self._error is not None or
                                (self._critical if b.critical else self._landed) >= b.item)
            if self._error is not None:
                raise KVSwapFailed("the KV copy thread failed: this stage's KV pools are unusable") from self._error
            event = self._copy_events.get((b.item, b.critical))
            for key in [k for k in self._copy_events if k[0] < b.item]:  # FIFO: later events cover them
                del self._copy_events[key]
        if event is not None:
            torch.cuda.current_stream(self.kv.k.device).wait_event(event)

    def computed(self, plan: PackedPlan) -> None:
        """The compute thread issued the plan's compute (or gave up on it): later copies may follow it."""
        if not self.threaded:
            return
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.kv.k.device))
        with self._cond:
            self._done += 1
            if event is not None:
                self._compute_events[self._done] = event
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._items.put(None)

    # ------------------------------------------------------------ the copy thread

    def _run(self) -> None:
        use_device(self.kv.k.device)   # its events and pinned buffers belong to the stage's GPU
        use_threads(1)   # copies are memory-bound: no second OpenMP team beside the compute thread's
        self._threads_set.set()
        item = 0
        try:
            while (entry := self._items.get()) is not None:
                n, plan = entry
                item += 1
                if not self._after_compute(n - self.depth):
                    return
                with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                    used = plan.block_ids()   # device blocks the compute touches
                    self._copy(plan, used, critical=True)
                    self._landed_part(item, critical=True)
                    self._copy(plan, used, critical=False)
                    self._landed_part(item, critical=False)
        except BaseException as e:  # surfaces in the compute thread's next wait, which ends the worker
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _after_compute(self, n: int) -> bool:
        """Wait until this stage's plan number n (if any) was computed; False when closed meanwhile."""
        if n < 1:
            return True
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._done >= n)
            if self._closed:
                return False
            event = self._compute_events.get(n)
            for key in [k for k in self._compute_events if k <= n]:
                del self._compute_events[key]
        if event is not None and self.stream is not None:
            self.stream.wait_event(event)
        return True

    def _copy(self, plan: PackedPlan, used: set[int], critical: bool | None = None) -> None:
        """Offloads, then uploads: those of blocks the plan's compute touches (critical), the others, or all (None)."""
        def part(pairs: list[tuple[int, int]], device_side: int) -> list[tuple[int, int]]:
            return pairs if critical is None else [p for p in pairs if (p[device_side] in used) == critical]
        self.host.offload(self.kv, part(plan.swap_out, 0))
        self.host.upload(self.kv, part(plan.swap_in, 1))

    def _landed_part(self, item: int, critical: bool) -> None:
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        with self._cond:
            if event is not None:
                self._copy_events[(item, critical)] = event
            if critical:
                self._critical = item
            else:
                self._landed = item
            self._cond.notify_all()
