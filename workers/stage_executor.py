"""The compute thread of a worker: builds the stage's model runner, then runs its stage of every
iteration, in control-frame order. Built here, not on the main thread, so the process has one
OpenMP team (orca_mq/runtime/threads.py).

The controller hands plans over through a queue and never waits for them; this thread
receives the previous stage's hidden states, launches its layers, and either sends the hidden
states on (data plane) or, on the last stage, queues the launched iteration for the collector
thread, which waits for its sampled tokens and hands them to the controller: the compute thread
meanwhile launches the next plan (async scheduling keeps one ready), so the device never waits for
the host's copy back, result message and next plan.

An exception in one iteration's compute fails that iteration's requests, not the worker: the
last stage reports them all failed; an earlier stage sends NaN hidden states on, so every later
stage stays in step and the last one's sampler reports those rows failed. Only the data plane
itself (a lost peer) and a failed KV copy thread (the stage's KV pools are then unusable) end the
thread, and with it the worker, which the launcher restarts.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from orca_mq.protocol.iteration import IterationResult, PackedPlan
from orca_mq.logs import summarize_ms
from orca_mq.runtime.device import use_device
from orca_mq.engine.model_runner import Launched, ModelRunner
from orca_mq.kv.swapper import KVSwapFailed
from workers.data_plane import DataPlane

WINDOW = 10_000

ResultCallback = Callable[[IterationResult, float, float], None]   # result, compute start, compute end
ErrorCallback = Callable[[BaseException], None]


class StageExecutor:
    def __init__(self, build: Callable[[], ModelRunner], data_plane: DataPlane, device: torch.device,
                 on_ready: Callable[[ModelRunner], None], on_result: ResultCallback, on_error: ErrorCallback,
                 log: Any) -> None:
        self.build = build
        self.device = device
        self.runner: ModelRunner | None = None
        self.on_ready = on_ready
        self.log = log
        self.data_plane = data_plane
        self.stage = data_plane.stage
        self.last = data_plane.stage == data_plane.n_stages - 1
        self.on_result = on_result
        self.on_error = on_error
        self._plans: queue.SimpleQueue[tuple[PackedPlan, float] | None] = queue.SimpleQueue()
        # the last stage's launched iterations, oldest first, for its collector thread
        self._launched: queue.SimpleQueue[tuple[PackedPlan, Launched | IterationResult | None, float, float] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle: deque[float] = deque(maxlen=WINDOW)      # previous compute end -> this compute start
        self._compute: deque[float] = deque(maxlen=WINDOW)
        self._plan_latency: deque[float] = deque(maxlen=WINDOW)  # scheduler sent the plan -> compute start
        self._shapes: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)  # (decodes, prompt tokens, compute s)
        self._last_end: float | None = None
        self.iterations = 0
        self.failed_iterations = 0
        self._thread = threading.Thread(target=self._run, name=f"compute-{self.stage}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, plan: PackedPlan, t_sent: float) -> None:
        self._plans.put((plan, t_sent))

    def stop(self) -> None:
        self._plans.put(None)

    def _run(self) -> None:
        collector = None
        try:
            use_device(self.device)   # CUDA's current device is per thread: the model, KV and buffers go here
            self.runner = self.build()
            if self.last:
                collector = threading.Thread(target=self._collect_loop, name=f"collect-{self.stage}", daemon=True)
                collector.start()
            self.on_ready(self.runner)
            while (item := self._plans.get()) is not None:
                self._step(*item)
        except BaseException as e:  # the controller turns this into a worker exit
            self.on_error(e)
        finally:
            self._launched.put(None)

    def _step(self, plan: PackedPlan, t_sent: float) -> None:
        """Launch the plan; the last stage's collector thread waits for its tokens, so the next plan
        is launched behind it (async scheduling) while they are copied back and sent."""
        assert self.runner is not None
        hidden = None
        if self.stage > 0:
            shape = (plan.num_tokens, self.runner.hidden_size)
            hidden = self.data_plane.recv(plan.iteration, shape, self.runner.dtype, self.runner.device)
        start = time.time()
        launched = self._guard(plan, lambda: self.runner.launch(plan, hidden))  # type: ignore[union-attr]
        if self.last:
            self._launched.put((plan, launched, t_sent, start))
            return
        out = launched.out if isinstance(launched, Launched) else torch.full(
            (plan.num_tokens, self.runner.hidden_size), float("nan"), dtype=self.runner.dtype, device=self.runner.device)
        assert isinstance(out, torch.Tensor)
        self.data_plane.send(plan.iteration, out)
        self._record(plan, launched, t_sent, start)

    def _collect_loop(self) -> None:
        try:
            use_device(self.device)
            while (item := self._launched.get()) is not None:
                plan, launched, t_sent, start = item
                if isinstance(launched, Launched):
                    result = self._guard(plan, lambda: self.runner.collect(launched))  # type: ignore[union-attr]
                else:
                    result = launched
                if result is not None:
                    assert isinstance(result, IterationResult)
                    self.on_result(result, start, time.time())
                self._record(plan, launched, t_sent, start)
        except BaseException as e:
            self.on_error(e)

    def _guard(self, plan: PackedPlan, work: Callable[[], Any]) -> Any:
        """`work` for this plan, or, when it fails, what its failure leaves: on the last stage a
        result failing every request (rank 0), elsewhere None (NaN goes on in its place)."""
        assert self.runner is not None
        try:
            return work()
        except KVSwapFailed:
            raise   # no later iteration could compute: the worker exits
        except Exception:
            self.log.exception("iteration failed; its requests end with an error", iteration=plan.iteration,
                               requests=plan.request_ids)
            with self._lock:
                self.failed_iterations += 1
            if self.last and self.runner.tp.where.rank == 0:
                rids = list(plan.request_ids)
                return IterationResult(plan.iteration, [0] * len(rids), rids)
            return None

    def _record(self, plan: PackedPlan, launched: object, t_sent: float, start: float) -> None:
        end = time.time()
        decodes = 0
        if isinstance(launched, Launched):
            a = launched.arrays
            decodes = int(((a.q_lens == 1) & (a.start_pos > 0)).sum())
        with self._lock:
            if self._last_end is not None:
                self._idle.append(max(0.0, start - self._last_end))
            self._compute.append(end - start)
            self._shapes.append((decodes, plan.num_tokens - decodes, end - start))
            self._plan_latency.append(start - t_sent)
            self._last_end = end
            self.iterations += 1

    def stats(self, reset: bool, record: bool = False) -> dict[str, Any]:
        """Idle gaps between this stage's iterations (scheduler + messaging + pipeline waits); with
        `record`, each recent iteration's [decodes, prompt tokens, compute ms] (what one batch
        composition costs under each policy: tools/scorecard.py)."""
        with self._lock:
            out = {"stage": self.stage, "iterations": self.iterations, "failed_iterations": self.failed_iterations,
                   "idle": summarize_ms(self._idle), "compute": summarize_ms(self._compute),
                   "plan_latency": summarize_ms(self._plan_latency)}
            if self.runner is not None and (sizing := self.runner.kv_sizing) is not None:
                out["kv_pool"] = sizing.as_dict()
            if self.runner is not None and (graphs := self.runner.graphs) is not None:
                out["cuda_graphs"] = {"buckets": graphs.sizes, "captured": len(graphs.graphs), "bytes": graphs.memory}
            if record:
                out["shapes"] = [[d, p, round(c * 1000, 3)] for d, p, c in self._shapes]
            if reset:
                self._idle.clear()
                self._compute.clear()
                self._plan_latency.clear()
                self._shapes.clear()
                self._last_end = None
        return out

