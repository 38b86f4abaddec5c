"""A worker's controller: the asyncio control loop of one pipeline stage.

For every control frame it first forwards the raw bytes down the control chain (its stage's other
TP ranks and the next stage; workers/control_chain.py) — before decoding, before any computation —
so downstream workers get their frames as early as possible, then hands
the plan to the compute thread and goes back to listening; it never waits on kernels. It also
answers stats queries through the broker; the last stage's tokens go to the scheduler from the
collector thread itself, on a socket only that thread uses, when the scheduler shares the node
(through the broker otherwise).
A malformed control frame reaches every stage the same way and each rejects it identically.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import zmq
import zmq.asyncio

from orca_mq.config import Config
from orca_mq.protocol.iteration import IterationResult
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.protocol import ProtocolError, decode, encode
from orca_mq.protocol.common_msgs import PROTOCOL, Error
from orca_mq.protocol.codec import channel
from orca_mq.protocol.control_msgs import Progress, Ready
from orca_mq.protocol.engine_msgs import ControlFrame, IterationDone, WorkerStats, WorkerStatsQuery
from orca_mq.server.zmq_queue import BrokerLink, serve
from workers.control_chain import ControlChain
from workers.data_plane import DataPlane
from workers.stage_executor import StageExecutor

CONTROL = channel(ControlFrame)
FROM_BROKER = channel(WorkerStatsQuery, Error)


class Controller:
    def __init__(self, cfg: Config, name: str, stage: int, tp_rank: int, run_dir: str, log: Any,
                 store: dist.Store | None) -> None:
        self.stage = stage
        self.name = name
        self.log = log
        self.ctx = zmq.asyncio.Context()
        self.chain = ControlChain(self.ctx, cfg, run_dir, (stage, tp_rank), store)
        self.link = BrokerLink(self.ctx, cfg.server.backend_address, self.name)
        self.executor: StageExecutor | None = None
        self.runner: ModelRunner | None = None
        self._failed: asyncio.Future[None] | None = None

    async def run(self, build: Callable[[], ModelRunner], data_plane: DataPlane, device: torch.device) -> int:
        """Serve until stopped; `build` makes the stage's runner on the compute thread, which computes on `device`."""
        loop = asyncio.get_running_loop()
        self._failed = loop.create_future()
        built: asyncio.Future[ModelRunner] = loop.create_future()
        # the compute thread reports through the event loop: the ZMQ sockets belong to this thread
        self.executor = StageExecutor(
            build, data_plane, device,
            on_ready=lambda r: loop.call_soon_threadsafe(built.set_result, r),
            on_result=ResultPush(self.chain.results_address) if self.chain.results_address else
            lambda r, t0, t1: loop.call_soon_threadsafe(self._send_result, r, t0, t1),
            on_error=lambda e: loop.call_soon_threadsafe(self._fail, e),
            log=self.log,
        )
        self.executor.start()
        await asyncio.wait([built, self._failed], return_when=asyncio.FIRST_COMPLETED)
        if self._failed.done():
            self._failed.result()   # the build failed: raise it, the worker exits
        self.runner = built.result()
        if (sizing := self.runner.kv_sizing) is not None and self.runner.tp.where.rank == 0:   # a line per stage
            await self.link.to_peer("launcher", Progress(self.name, f"KV pool from the device's memory: {sizing.describe()}"))
        await self.link.to_peer("launcher", Ready(self.name, os.getpid(), self.runner.pool.device_slots))
        code = await serve([self._control_loop(), self._broker_loop(), self._compute_watch()], self.log)
        self.executor.stop()
        self.chain.close()
        self.link.close()
        self.ctx.term()
        return code

    async def _compute_watch(self) -> None:
        assert self._failed is not None
        await self._failed

    async def _control_loop(self) -> None:
        assert self.executor is not None and self.runner is not None
        while True:
            frame = await self.chain.recv()
            await self.chain.forward(frame)
            try:
                msg = decode(frame, CONTROL)
            except ProtocolError as e:
                self.log.warning("rejected control frame", error=str(e))
                await self.link.to_peer("scheduler", Error(f"{self.name}: {e}", code=PROTOCOL))
                continue
            self.log.debug("iteration received", iteration=msg.plan.iteration, batch=len(msg.plan.request_ids))
            self.runner.prepare(msg.plan)  # FastServe: start its KV copies now, beside earlier computations
            self.executor.submit(msg.plan, msg.t_sent)

    async def _broker_loop(self) -> None:
        assert self.executor is not None
        async for env in self.link.envelopes(self.log):
            try:
                msg = decode(env.payload, FROM_BROKER)
            except ProtocolError as e:
                await self.link.reject(env, e, self.log)
                continue
            if isinstance(msg, WorkerStatsQuery):
                await self.link.to_peer(env.source, WorkerStats(msg.query_id, self.stage, self.executor.stats(msg.reset, msg.record)))
            else:
                self.log.warning("error from a process", error=msg.error)

    def _send_result(self, result: IterationResult, start: float, end: float) -> None:
        asyncio.ensure_future(self.link.to_peer("scheduler", IterationDone(result, start, end)))

    def _fail(self, error: BaseException) -> None:
        self.log.error("compute thread failed", exc_info=error)
        assert self._failed is not None
        if not self._failed.done():
            self._failed.set_exception(error)


class ResultPush:
    """The last stage's results straight to the scheduler, called on the collector thread: the
    socket is made on its first call there and used by no other thread (ZeroMQ sockets are not
    thread-safe); LINGER 0 so that it never holds the process at exit."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock: zmq.Socket[Any] | None = None

    def __call__(self, result: IterationResult, start: float, end: float) -> None:
        if self.sock is None:
            self.sock = zmq.Context.instance().socket(zmq.PUSH)
            self.sock.setsockopt(zmq.SNDHWM, 0)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.address)
        self.sock.send(encode(IterationDone(result, start, end)), copy=False)
