"""The iteration scheduler process: owns the request pool (the scheduler object of
orca_mq.sched, policy from `scheduler.policy`) and drives the worker pipeline with its `step()`.

On every message it takes one turn of the loop: the returned iteration's tokens are applied, the
plans `step` gives (at most `engine.n_workers` in flight, one per pipeline stage, ORCA §4.2) go on
the control chain to worker 0 at once, and then the tokens stream to the frontend. Results come on
their own socket from a last stage on this node (the broker's link brings the rest); one lock keeps
the turns whole, so plans leave and tokens stream in the order the scheduler made them. A policy that
needs this engine's iteration profile times its probes the same way, through the whole pipeline,
before the process reports ready.
"""
from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from orca_mq.admission.served_model import ServedModel
from orca_mq.config import Config
from orca_mq.logs import setup_logging, summarize_ms
from orca_mq.protocol import ProtocolError, decode, encode
from orca_mq.protocol.common_msgs import PROTOCOL, Error
from orca_mq.protocol.codec import channel
from orca_mq.protocol.control_msgs import Progress, Ready
from orca_mq.protocol.frames import frames
from orca_mq.protocol.iteration import IterationResult, pack
from orca_mq.protocol.engine_msgs import (AbortRequest, AddRequest, ControlFrame, IterationDone, StatsQuery,
                                          StatsResult, TokenBatch, WorkerStats, WorkerStatsQuery)
from orca_mq.sched import StepOutput, TokenColumns, TokenEvent, Tokens, events_of, make_scheduler
from orca_mq.sched.events import n_rows
from orca_mq.sched.request import Request
from orca_mq.structured.compiler import Known, bounded
from orca_mq.server.telemetry import Telemetry
from orca_mq.server.turn_cpu import TurnCpu
from orca_mq.server.process import process_main
from orca_mq.server.nodes import worker_name
from orca_mq.server.zmq_queue import PEER, BrokerLink, Envelope, control_address, results_address, serve

FRONTEND = b"frontend"

ACCEPTED = channel(AddRequest, AbortRequest, StatsQuery, IterationDone, WorkerStats, Error)
WINDOW = 10_000          # timing samples kept for the stats


@dataclass(slots=True)
class _StatsQuery:
    source: bytes
    query: StatsQuery
    workers: dict[int, dict[str, Any]] = field(default_factory=dict)



class SchedulerProcess:
    def __init__(self, cfg: Config, run_dir: str) -> None:
        self.cfg = cfg
        self.log = setup_logging("scheduler", cfg.log)
        self.model = ServedModel(cfg)   # admission's step 4 here (orca_mq.admission): grammars and Requests
        self.sched = make_scheduler(cfg, self.model.info)
        self.ctx = zmq.asyncio.Context()
        self.link = BrokerLink(self.ctx, cfg.server.backend_address, "scheduler")
        self.control = self.ctx.socket(zmq.PUSH)
        self.control.setsockopt(zmq.SNDHWM, 0)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.connect(control_address(run_dir, 0))
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.RCVHWM, 0)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.bind(results_address(run_dir))
        self.last_stage = worker_name(cfg.engine.n_workers - 1, 0).encode()
        self.turn = asyncio.Lock()   # one message's turn at a time, whichever socket brought it
        self.arrivals: deque[str] = deque(maxlen=WINDOW)    # FCFS checks: order of arrival here
        self.turnaround: deque[float] = deque(maxlen=WINDOW)  # result received -> next plan sent
        self.result_latency: deque[float] = deque(maxlen=WINDOW)  # last stage done -> result received
        self.queries: dict[str, _StatsQuery] = {}
        self.telemetry = Telemetry()        # cumulative histograms for the API server's /metrics
        self.turn_cpu = TurnCpu()           # the main thread's CPU by part of its turn, for the stats
        self.grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.compiling: dict[str, bool] = {}    # requests waiting for their grammar -> aborted meanwhile
        self.compile_tasks: set[asyncio.Task[None]] = set()
        self.failed: asyncio.Future[None] | None = None   # a compile task's turn that failed: the process ends
        self.ready = False
        self.started = time.perf_counter()

    async def run(self) -> int:
        if not self.sched.profiled:
            await self.link.to_peer("launcher", Progress("scheduler", "timing the probe iterations of the policy's profile"))
        self.failed = asyncio.get_running_loop().create_future()
        await self._step([])
        code = await serve([self._loop(), self._results_loop(), self._watch()], self.log)
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.link.close()
        self.control.close()
        self.results.close()
        self.ctx.term()
        return code

    async def _loop(self) -> None:
        async for env in self.link.envelopes(self.log):
            async with self.turn:
                await self._handle(env)

    async def _results_loop(self) -> None:
        while True:
            payload = await self.results.recv(copy=True)
            async with self.turn:
                await self._handle(Envelope(PEER, self.last_stage, payload))

    async def _watch(self) -> None:
        """Ends the process when a compile task's turn failed, as a failed turn of the loops does: the
        launcher restarts it and the broker gives every request in flight its final."""
        assert self.failed is not None
        await self.failed

    async def _handle(self, env: Envelope) -> None:
        received, start = time.time(), time.thread_time()
        try:
            msg = decode(env.payload, ACCEPTED)
            self.turn_cpu.since("decode", start)
        except ProtocolError as e:
            await self.link.reject(env, e, self.log)
            return
        if isinstance(msg, IterationDone):
            if not self.sched.expects(msg.result.iteration):  # a stray frame: nothing to apply it to
                await self.link.to_peer(env.source, Error(f"scheduler: iteration {msg.result.iteration} is not in flight", None, PROTOCOL))
                return
            self.result_latency.append(received - msg.t_end)
            self.telemetry.iteration_done(msg.result.iteration, time.monotonic())
            if await self._step([msg.result]):  # the engine first, then the stream: tokens wait microseconds, stages do not
                self.turnaround.append(time.time() - received)
            return
        if isinstance(msg, AddRequest):
            try:
                if msg.params.structured_outputs is not None:  # it waits, unscheduled, for its grammar
                    self.compiling[msg.request_id] = False
                    task = asyncio.create_task(self._compile_and_add(msg))
                    self.compile_tasks.add(task)
                    task.add_done_callback(self._compiled)
                    return
                self._add(self.model.request(msg.request_id, msg.prompt_token_ids, msg.params, client=msg.client,
                                             pooling=msg.pooling))
            except Exception:  # the frontend validated it: a refusal here is a bug, fail only this request
                await self._refused(msg.request_id)
                return
        elif isinstance(msg, AbortRequest):
            if msg.request_id in self.compiling:
                self.compiling[msg.request_id] = True
                return
            await self._emit(-1, [self.sched.abort(msg.request_id)])
        elif isinstance(msg, StatsQuery):
            await self._start_stats(env.source, msg)
        elif isinstance(msg, WorkerStats):
            await self._worker_stats(msg)
        elif isinstance(msg, Error):
            self.log.warning("error from a process", source=env.source.decode(errors="replace"), error=msg.error)
        await self._step([])

    def _add(self, req: Request) -> None:
        self.sched.add(req)
        self.arrivals.append(req.request_id)

    async def _refused(self, request_id: str) -> None:
        self.log.error("request refused by the scheduler", request_id=request_id, exc_info=True)
        await self._emit(-1, [[TokenEvent(request_id, None, "error")]])

    def _compiled(self, task: asyncio.Task[None]) -> None:
        self.compile_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failed is not None and not self.failed.done():
            self.failed.set_exception(task.exception())   # type: ignore[arg-type]

    async def _compile_and_add(self, msg: AddRequest) -> None:
        """Compile a constrained request's grammar off the event loop (with the shortest plan the
        frontend found: not searched again), then let it be scheduled."""
        rid = msg.request_id
        compile = functools.partial(self.model.grammars.compile, known=Known(msg.start) if msg.start_known else None)
        try:
            grammar = await bounded(self.grammar_pool, compile, msg.params.structured_outputs,  # type: ignore[arg-type]
                                    self.cfg.structured.compile_timeout)
        except Exception:  # the frontend checked it: only the vocabulary or the clock refuse it here
            self.log.exception("grammar compilation failed", request_id=rid)
            grammar = None
        async with self.turn:
            if self.compiling.pop(rid, False):
                await self._emit(-1, [[TokenEvent(rid, None, "abort")]])
            elif grammar is None:
                await self._refused(rid)
            else:
                try:
                    self._add(self.model.request(rid, msg.prompt_token_ids, msg.params, grammar, msg.client))
                except Exception:  # as in _handle: a refusal here is a bug, fail only this request
                    await self._refused(rid)
                    return
                await self._step([])   # a failure here fails the process (_watch), as in the loops

    async def _step(self, results: list[IterationResult]) -> bool:
        """One turn of the scheduler's loop: its plans go out first, then its tokens. Returns whether
        a plan was sent."""
        start = time.thread_time()
        out: StepOutput = self.sched.step(time.monotonic(), results)
        start = self.turn_cpu.since("step", start)
        for plan in out.plans:
            await self.control.send(encode(ControlFrame(pack(plan), time.time())), copy=False)
            if plan.iteration > 0:
                self.telemetry.plan_sent(plan, self.sched.pool, time.monotonic())
            self.log.debug("iteration scheduled", iteration=plan.iteration, batch=plan.num_rows, tokens=plan.num_tokens)
        start = self.turn_cpu.since("plan_frames", start)
        if results:
            await self._emit(results[0].iteration, out.tokens)
            self.turn_cpu.since("token_frames", start)
        if not self.ready and self.sched.profiled:
            self.ready = True
            if self.sched.profile is not None:
                self.log.info("iteration profile measured", seconds=round(time.perf_counter() - self.started, 2),
                              **self.sched.profile.to_dict())
            await self.link.to_peer("launcher", Ready("scheduler", os.getpid()))
            self.model.warm_grammars(self.grammar_pool)
        return bool(out.plans)

    async def _emit(self, iteration: int, parts: list[Tokens]) -> None:
        """A step's tokens to the frontend: one frame, or several in order where one would exceed the bound."""
        if n := n_rows(parts):
            fm = self.sched.final_metrics
            batch = token_batch(iteration, parts, fm)
            self.telemetry.finished(batch.metrics.values())
            events: list[TokenEvent] = []   # split only when too large: rows as events, then

            def build(lo: int, hi: int) -> TokenBatch:
                if hi - lo == n:
                    return batch
                if not events:
                    events.extend(events_of(parts))
                return token_batch(iteration, [events[lo:hi]], fm)

            for frame in frames(build, n):
                await self.link.send_raw(PEER, FRONTEND, frame)

    async def _start_stats(self, source: bytes, query: StatsQuery) -> None:
        qid = uuid.uuid4().hex
        self.queries[qid] = _StatsQuery(source, query)
        for stage in range(self.cfg.engine.n_workers):
            await self.link.to_peer(f"worker{stage}", WorkerStatsQuery(qid, query.reset, query.record))
        asyncio.get_running_loop().call_later(self.cfg.server.stats_timeout, lambda: asyncio.ensure_future(self._answer_stats(qid)))

    async def _worker_stats(self, msg: WorkerStats) -> None:
        pending = self.queries.get(msg.query_id)
        if pending is not None:
            pending.workers[msg.stage] = msg.stats
            if len(pending.workers) == self.cfg.engine.n_workers:
                await self._answer_stats(msg.query_id)

    async def _answer_stats(self, qid: str) -> None:
        pending = self.queries.pop(qid, None)
        if pending is None:
            return  # answered already
        q = pending.query
        stats: dict[str, Any] = {
            "scheduler": self.sched.stats() | {
                "n_in_flight": self.sched.n_in_flight,
                "has_work": self.sched.has_work(),
                "compiling": len(self.compiling),   # constrained requests waiting for their grammar
                "turnaround": summarize_ms(self.turnaround),
                "result_latency": summarize_ms(self.result_latency),
                "turn_cpu_s": self.turn_cpu.to_dict(),
            },
            "workers": [pending.workers.get(s) for s in range(self.cfg.engine.n_workers)],
            "telemetry": self.telemetry.to_dict(self.sched.pool),
        }
        if q.record:
            stats["record"] = [[it, list(rids)] for it, rids in self.sched.record]
            stats["arrival_order"] = list(self.arrivals)
        if q.reset:
            self.turnaround.clear()
            self.result_latency.clear()
        await self.link.to_peer(pending.source, StatsResult(q.query_id, stats))


def token_batch(iteration: int, parts: list[Tokens], final_metrics: Callable[[TokenEvent], dict[str, Any]]) -> TokenBatch:
    """A step's tokens as one TokenBatch: two flat columns of tokens (msgpack packs them in C; a columnar
    iteration's are its plan's id list and its result's token list, read, not copied), the few finals with
    their metrics (the scheduler's and the event's) beside."""
    if len(parts) == 1 and isinstance(parts[0], TokenColumns):
        rids, tokens, ends = parts[0].request_ids, parts[0].token_ids, list(parts[0].finals.values())
    else:
        rids, tokens, ends = [], [], []
        for p in parts:
            if isinstance(p, TokenColumns):
                rids += p.request_ids
                tokens += p.token_ids
                ends += p.finals.values()
                continue
            for e in p:
                if e.token_id is not None:
                    rids.append(e.request_id)
                    tokens.append(e.token_id)
                if e.finish_reason:
                    ends.append(e)
    batch = TokenBatch(iteration, rids, tokens)
    for e in ends:
        batch.finals[e.request_id] = e.finish_reason   # type: ignore[assignment]
        if m := final_metrics(e):
            batch.metrics[e.request_id] = m
        if e.embedding is not None:
            batch.embeddings[e.request_id] = e.embedding
    if any(e.logprobs is not None or e.prompt_logprobs is not None for p in parts if not isinstance(p, TokenColumns) for e in p):
        _logprob_columns(batch, parts)
    return batch


def _logprob_columns(batch: TokenBatch, parts: list[Tokens]) -> None:
    """The events' log probabilities beside their tokens (only when one of them has any; a columnar
    iteration's rows have none)."""
    for p in parts:
        if isinstance(p, TokenColumns):
            batch.logprobs += [None] * len(p.token_ids)
            continue
        batch.logprobs += [e.logprobs for e in p if e.token_id is not None]
        batch.prompt_logprobs |= {e.request_id: e.prompt_logprobs for e in p if e.prompt_logprobs is not None}


def main() -> None:
    process_main("scheduler", "orca-mq iteration scheduler", lambda cfg, args: SchedulerProcess(cfg, args.run_dir).run(),
                 ("--run-dir", {"required": True, "help": "directory of the workers' control sockets"}))


if __name__ == "__main__":
    main()
