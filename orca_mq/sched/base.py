"""Iteration-level schedulers over one request pool: ORCA (Algorithm 1) and the request-level baseline.

A scheduler is pure bookkeeping (no I/O): `schedule()` returns the next iteration to run,
`process_result()` takes its tokens back. The offline LLM and the scheduler process drive the
same objects, so what is tested here is what serves.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from orca_mq.protocol.iteration import IterationPlan, IterationResult, SeqWork
from orca_mq.sched.block_manager import BlockManager
from orca_mq.sched.request import Phase, Request

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.engine.model_info import ModelInfo
    from orca_mq.sched.profiler import IterationProfile, Profiler

RECORD_WINDOW = 10_000   # iterations kept in `record`: it is read by tests and stats, and must not grow forever


@dataclass(slots=True)
class TokenEvent:
    request_id: str
    token_id: int | None            # None on a final event that carries no new token (abort)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" when the request is done


class Scheduler:
    """What every policy shares: the pool, KV blocks, iterations in flight, finishing."""

    swaps_kv: ClassVar[bool] = False  # plans carry KV offloads/uploads: workers copy them on their own thread

    def __init__(self, cfg: "Config", info: "ModelInfo") -> None:
        self.max_bs = cfg.scheduler.max_bs
        self.token_budget = cfg.scheduler.max_num_batched_tokens  # 0: no budget, whole prompts (ORCA)
        self.n_workers = cfg.engine.n_workers
        self.block_manager = BlockManager(cfg.engine.n_slots // cfg.engine.block_size, cfg.engine.block_size)
        self.eos_token_ids = set(info.eos_token_ids)
        self.pool: dict[str, Request] = {}            # insertion order = arrival order
        self.in_flight: dict[int, list[Request]] = {}
        self.iteration = 0
        self.record: deque[tuple[int, list[str]]] = deque(maxlen=RECORD_WINDOW)  # (iteration, request ids) for FCFS checks
        if self.max_bs < 1 or self.n_workers < 1 or self.token_budget < 0:
            raise ValueError("max_bs and n_workers must be >= 1, max_num_batched_tokens >= 0")

    # ------------------------------------------------------------ pool

    def add(self, req: Request) -> None:
        if req.request_id in self.pool:
            raise ValueError(f"duplicate request id {req.request_id}")
        self.pool[req.request_id] = req

    def abort(self, request_id: str) -> TokenEvent | None:
        req = self.pool.get(request_id)
        if req is None:
            return None
        if req.running:  # its iteration is in flight: finish when the tokens come back
            req.aborted = True
            return None
        self._finish(req, "abort")
        return TokenEvent(request_id, None, "abort")

    def has_work(self) -> bool:
        return bool(self.pool) or bool(self.in_flight)

    @property
    def n_in_flight(self) -> int:
        return len(self.in_flight)

    def stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "n_slots": bm.num_blocks * bm.block_size, "free_slots": bm.num_free_slots,
            "used_slots": bm.num_used_slots, "waiting": sum(not r.running for r in self.pool.values()),
            "running": sum(r.running for r in self.pool.values()), "in_flight": len(self.in_flight),
            "iterations": self.iteration,
        }

    # ------------------------------------------------------------ iterations

    def schedule(self, now: float) -> IterationPlan | None:
        """The next iteration, or None when the pipeline is full or nothing can run."""
        if len(self.in_flight) >= self.n_workers:
            return None
        batch = self.fit_budget(self.select(now))
        if not batch:
            return None
        self.admitted(batch, now)
        seqs = []
        for req in batch:
            tokens, start = req.next_tokens(req.chunk or None)
            if req.phase is Phase.INITIATION:
                req.n_prompt_fed = start + len(tokens)
            table = self.block_manager.ensure(req.request_id, start + len(tokens))
            p = req.params
            seqs.append(SeqWork(req.request_id, tokens, start, list(table), p.temperature, p.top_k, p.top_p, p.seed,
                                sample=not req.prompt_pending))
            req.running = True
        self.iteration += 1
        plan = IterationPlan(self.iteration, seqs)
        self.in_flight[plan.iteration] = batch
        self.record.append((plan.iteration, [r.request_id for r in batch]))
        return plan

    def fit_budget(self, batch: list[Request]) -> list[Request]:
        """Sarathi-Serve's stall-free batching under a token budget (scheduler.max_num_batched_tokens):
        every increment request in the batch gets its one token first, then the prompts share what is
        left, in batch order, a chunk each; a prompt left with no budget waits for a later iteration.
        Sets each request's `chunk`."""
        left = self.token_budget - sum(r.phase is Phase.INCREMENT for r in batch) if self.token_budget else None
        kept = []
        for req in batch:
            req.chunk = 0
            if req.phase is Phase.INITIATION:
                policy = self.prompt_chunk(req)
                req.chunk = req.prompt_left if policy is None else min(policy, req.prompt_left)
                if left is not None:
                    req.chunk = min(req.chunk, max(left, 0))
                    left -= req.chunk
                if req.chunk == 0:
                    continue
            kept.append(req)
        return kept

    def process_result(self, result: IterationResult, now: float) -> list[TokenEvent]:
        batch = self.in_flight.pop(result.iteration, None)
        if batch is None or [r.request_id for r in batch] != list(result.request_ids):
            raise ValueError(f"result of iteration {result.iteration} does not match any iteration in flight")
        events = []
        failed = set(result.failed)
        for req, token in zip(batch, result.token_ids):
            req.running = False
            if req.phase is Phase.FINISHED:  # the request-level baseline's inactive request: compute wasted
                continue
            req.n_iterations += 1
            if req.aborted or req.request_id in failed:  # its work failed on a worker: it ends, the batch goes on
                reason = "abort" if req.aborted else "error"
                self._finish(req, reason)
                events.append(TokenEvent(req.request_id, None, reason))
                continue
            if req.prompt_pending:  # part of its prompt still to feed: what the engine sampled is dropped
                continue
            req.output_token_ids.append(token)
            req.phase = Phase.INCREMENT
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._stop_reason(req, token)
            if reason:
                self._finish(req, reason, now)
            events.append(TokenEvent(req.request_id, token, reason))
        self.after_iteration(batch, now)
        return self.emit(events)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        if not req.params.ignore_eos and token in self.eos_token_ids or token in req.params.stop_token_ids:
            return "stop"
        return "length" if len(req.output_token_ids) >= req.params.max_tokens else None

    def _finish(self, req: Request, reason: str, now: float | None = None) -> None:
        req.phase, req.finish_reason, req.finish_time = Phase.FINISHED, reason, now
        self._retire(req)

    def _retire(self, req: Request) -> None:
        """A finished request leaves the pool and frees its KV."""
        del self.pool[req.request_id]
        self.block_manager.free(req.request_id)
        self.release(req)

    # ------------------------------------------------------------ policy hooks

    def profiler(self) -> "Profiler | None":
        """Iterations to time on the real engine before any request (FastServe's skip-join profile)."""
        return None

    def use_profile(self, profile: "IterationProfile") -> None:
        """The timings of `profiler()`'s plans, fitted."""

    def select(self, now: float) -> list[Request]:
        raise NotImplementedError

    def prompt_chunk(self, req: Request) -> int | None:
        """How many prompt tokens a request in INITIATION may feed this iteration, before the token
        budget (None: all, as ORCA does)."""
        return None

    def admitted(self, batch: list[Request], now: float) -> None:
        """The batch of the iteration being planned, after the token budget dropped what did not fit."""

    def release(self, req: Request) -> None:
        """A request left the pool: return whatever the policy holds for it."""

    def after_iteration(self, batch: list[Request], now: float) -> None:
        """An iteration's tokens were appended (FastServe preempts and demotes here)."""

    def emit(self, events: list[TokenEvent]) -> list[TokenEvent]:
        return events

    def request_metrics(self, request_id: str) -> dict[str, Any] | None:
        """Policy-specific metrics of a request for its final message (FastServe: queues, swaps)."""
        return None
