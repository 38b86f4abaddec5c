"""The compute thread of a worker: builds the stage's model runner, then runs its stage of every
iteration, in control-frame order. Built here, not on the main thread, so the process has one
OpenMP team (orca_mq/engine/threads.py).

The controller hands plans over through a queue and never waits for them; this thread
receives the previous stage's hidden states, runs its layers, and either sends the hidden
states on (data plane) or, on the last stage, hands the sampled tokens back to the controller.

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

from orca_mq.protocol.iteration import IterationPlan, IterationResult
from orca_mq.logs import summarize_ms
from orca_mq.engine.device import use_device
from orca_mq.engine.model_runner import ModelRunner
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
        self._plans: queue.SimpleQueue[tuple[IterationPlan, float] | None] = queue.SimpleQueue()
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

    def submit(self, plan: IterationPlan, t_sent: float) -> None:
        self._plans.put((plan, t_sent))

    def stop(self) -> None:
        self._plans.put(None)

    def _run(self) -> None:
        try:
            use_device(self.device)   # CUDA's current device is per thread: the model, KV and buffers go here
            self.runner = self.build()
            self.on_ready(self.runner)
            while (item := self._plans.get()) is not None:
                self._step(*item)
        except BaseException as e:  # the controller turns this into a worker exit
            self.on_error(e)

    def _step(self, plan: IterationPlan, t_sent: float) -> None:
        assert self.runner is not None
        hidden = None
        if self.stage > 0:
            shape = (plan.num_tokens, self.runner.hidden_size)
            hidden = self.data_plane.recv(plan.iteration, shape, self.runner.dtype, self.runner.device)
        start = time.time()
        out = self._execute(plan, hidden)
        if self.last:  # TP ranks other than 0 hold the same logits and report nothing
            end = time.time()
            if out is not None:
                assert isinstance(out, IterationResult)
                self.on_result(out, start, end)
        else:
            assert isinstance(out, torch.Tensor)
            self.data_plane.send(plan.iteration, out)
            end = time.time()
        with self._lock:
            if self._last_end is not None:
                self._idle.append(start - self._last_end)
            self._compute.append(end - start)
            decodes = sum(len(s.token_ids) == 1 and s.start_pos > 0 for s in plan.seqs)
            self._shapes.append((decodes, plan.num_tokens - decodes, end - start))
            self._plan_latency.append(start - t_sent)
            self._last_end = end
            self.iterations += 1

    def _execute(self, plan: IterationPlan, hidden: torch.Tensor | None) -> torch.Tensor | IterationResult | None:
        assert self.runner is not None
        try:
            return self.runner.execute(plan, hidden)
        except KVSwapFailed:
            raise   # no later iteration could compute: the worker exits
        except Exception:
            self.log.exception("iteration failed; its requests end with an error", iteration=plan.iteration,
                               requests=[s.request_id for s in plan.seqs])
            with self._lock:
                self.failed_iterations += 1
            if self.last:
                rids = [s.request_id for s in plan.seqs]
                return IterationResult(plan.iteration, rids, [0] * len(rids), rids) if self.runner.tp.where.rank == 0 else None
            return torch.full((plan.num_tokens, self.runner.hidden_size), float("nan"),
                              dtype=self.runner.dtype, device=self.runner.device)

    def stats(self, reset: bool, record: bool = False) -> dict[str, Any]:
        """Idle gaps between this stage's iterations (scheduler + messaging + pipeline waits); with
        `record`, each recent iteration's [decodes, prompt tokens, compute ms] (what one batch
        composition costs under each policy: tools/scorecard.py)."""
        with self._lock:
            out = {"stage": self.stage, "iterations": self.iterations, "failed_iterations": self.failed_iterations,
                   "idle": summarize_ms(self._idle), "compute": summarize_ms(self._compute),
                   "plan_latency": summarize_ms(self._plan_latency)}
            if record:
                out["shapes"] = [[d, p, round(c * 1000, 3)] for d, p, c in self._shapes]
            if reset:
                self._idle.clear()
                self._compute.clear()
                self._plan_latency.clear()
                self._shapes.clear()
                self._last_end = None
        return out

