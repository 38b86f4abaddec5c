"""A stage's KV swap thread (FastServe): offloads and uploads run beside the compute thread.

The controller hands each plan over as its control frame arrives (`ModelRunner.prepare`), so the
copies start while the compute thread is still busy with earlier iterations; before computing a
plan, the compute thread waits (`ModelRunner.swap`) only for what that plan touches: every earlier
plan's copies, and its own offloads of and uploads into blocks of its block tables (an offloaded
block may be reused at once). Proactive offloads and uploads of jobs that run later keep going
meanwhile; the next plan waits for them.

One FIFO thread per stage keeps the scheduler's order: plan by plan, offloads before uploads (a
device block freed by an offload may receive an upload of the same plan; host blocks are never
reused within a plan).
On CUDA the copies run on their own stream into pinned host memory, and the compute stream waits
on CUDA events rather than on the host; on CPU they are plain copies into the host pool tensor.
"""
from __future__ import annotations

import queue
import threading
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from orca_mq.protocol.iteration import IterationPlan
from orca_mq.engine.kv_cache import KVCache
from orca_mq.engine.device import use_device
from orca_mq.engine.threads import use_threads


@dataclass(slots=True)
class _Barrier:
    item: int                   # this many queued copy items must have landed...
    critical: bool              # ...the last one only up to its critical part (the plan's own)


class KVSwapper:
    def __init__(self, kv: KVCache, host_blocks: int) -> None:
        self.kv = kv
        self.host = kv.host_pool(host_blocks)
        self.stream = torch.cuda.Stream(kv.k.device) if kv.k.is_cuda else None
        self._items: queue.SimpleQueue[IterationPlan | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._barriers: dict[int, _Barrier] = {}
        self._queued = 0
        self._critical = 0      # items whose critical part landed
        self._landed = 0        # items wholly landed
        self._events: dict[tuple[int, bool], torch.cuda.Event] = {}
        self._error: BaseException | None = None
        self._threads_set = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-swap", daemon=True)
        self._thread.start()
        self._threads_set.wait()   # its use_threads(1) is done: the compute thread may now set its own last

    def submit(self, plan: IterationPlan) -> None:
        """Queue the plan's copies (idempotent). A plan without copies only waits for earlier ones."""
        with self._cond:
            if plan.iteration in self._barriers:
                return
            if plan.swap_out or plan.swap_in:
                self._queued += 1
                self._barriers[plan.iteration] = _Barrier(self._queued, True)
                self._items.put(plan)
            else:
                self._barriers[plan.iteration] = _Barrier(self._queued, False)

    def wait(self, plan: IterationPlan) -> None:
        """Block the compute thread until the copies this plan reads have landed."""
        self.submit(plan)
        with self._cond:
            b = self._barriers.pop(plan.iteration)
            self._cond.wait_for(lambda: self._error is not None or
                                (self._critical if b.critical else self._landed) >= b.item)
            if self._error is not None:
                raise RuntimeError("KV swap thread failed") from self._error
            event = self._events.get((b.item, b.critical))
            for key in [k for k in self._events if k[0] < b.item]:  # FIFO: later events cover them
                del self._events[key]
        if event is not None:
            torch.cuda.current_stream(self.kv.k.device).wait_event(event)

    def close(self) -> None:
        self._items.put(None)

    def _run(self) -> None:
        use_device(self.kv.k.device)   # its events and pinned buffers belong to the stage's GPU
        use_threads(1)   # copies are memory-bound: no second OpenMP team beside the compute thread's
        self._threads_set.set()
        item = 0
        try:
            while (plan := self._items.get()) is not None:
                item += 1
                used = {b for s in plan.seqs for b in s.block_table}   # device blocks the compute touches
                out_now = [p for p in plan.swap_out if p[0] in used]
                in_now = [p for p in plan.swap_in if p[1] in used]
                with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                    self.kv.copy_blocks(self.host, out_now)
                    self.host.copy_blocks(self.kv, in_now)
                    self._landed_part(item, critical=True)
                    self.kv.copy_blocks(self.host, [p for p in plan.swap_out if p[0] not in used])
                    self.host.copy_blocks(self.kv, [p for p in plan.swap_in if p[1] not in used])
                    self._landed_part(item, critical=False)
        except BaseException as e:  # surfaces in the compute thread's next wait
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _landed_part(self, item: int, critical: bool) -> None:
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            with self._cond:
                self._events[(item, critical)] = event
        with self._cond:
            if critical:
                self._critical = item
            else:
                self._landed = item
            self._cond.notify_all()
