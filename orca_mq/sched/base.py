"""What every iteration-level scheduling policy shares: the request pool, KV blocks, the iteration loop.

A scheduler is pure bookkeeping (no I/O). `step(now, results)` is the one iteration loop: it applies
the returned iterations' tokens (finishes, preemption) and plans the next iterations while fewer
than `n_workers` are in flight. The offline `LLM`, the scheduler process and `tools/simulate.py`
all drive it; they differ only in where plans go and where results come from, so what is tested
or simulated here is what serves.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from orca_mq.protocol.iteration import NO_ROW, IterationPlan, IterationResult, SeqWork, pack
from orca_mq.engine.dtype import resolve_dtype
from orca_mq.fair_share import in_turn
from orca_mq.kv.block_manager import BlockManager
from orca_mq.kv.pool import PoolSize
from orca_mq.kv.prefix import chain_seed
from orca_mq.runtime.device import uses_cuda
from orca_mq.sched.profiler import IterationProfile, Profiler, profile_max_len
from orca_mq.sched import closings
from orca_mq.sched.events import StepOutput, TokenEvent, Tokens, events_of
from orca_mq.sched.columns import DecodeColumns, apply_decode, decode_rows, decodes, decoding, merge, plan_decode
from orca_mq.sched.request import PHASE, Phase, Request
from orca_mq.sched.pooling import PooledRows, ask_pooling, max_pooled_rows
from orca_mq.sched.processors import add_extras
from orca_mq.sched.speculative import Speculator
from orca_mq.structured.bitmask import fill_masks
from orca_mq.structured.budget import Budget

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.models.info import ModelInfo

RECORD_WINDOW = 10_000   # iterations kept in `record`: it is read by tests and stats, and must not grow forever
KEPT_METRICS = 10_000    # finished requests whose metrics stay available
CPU_CLIENT_ROWS = 2      # scheduler.client_rows' auto on a CPU (tools/bench_fairness.py: BENCHMARKS.md, stops 61-62, 65)


def async_scheduling(cfg: "Config", policy: type["Scheduler"]) -> bool:
    """`scheduler.async_scheduling`: auto = on where the engine runs on CUDA in one worker (on the CPU
    the engine, not the host, is the bottleneck) and the policy can plan ahead."""
    mode = cfg.scheduler.async_scheduling
    if mode == "on" and not policy.plans_ahead:
        raise ValueError(f"scheduler.async_scheduling = on: policy {cfg.scheduler.policy} cannot plan an iteration "
                         "before the last one's tokens return (it reorders or swaps after each); use auto or off")
    if mode == "off" or not policy.plans_ahead or cfg.engine.n_workers * cfg.engine.tp_size != 1:
        return False
    if mode == "on":
        return True
    return uses_cuda(cfg.engine.device)


def client_rows(cfg: "Config") -> int:
    """`scheduler.client_rows`: auto (-1) = CPU_CLIENT_ROWS on a CPU, where every row of an iteration costs
    every other row time (the sampler's passes, the model's arithmetic on a few cores), no cap on CUDA."""
    rows = cfg.scheduler.client_rows
    return rows if rows >= 0 else 0 if uses_cuda(cfg.engine.device) else CPU_CLIENT_ROWS


def prompt_order(prompts: list[Request], left: int | None) -> list[Request]:
    """The order in which prompts take an iteration's budget (`left` tokens; None: no budget): the
    batch's, except that the prompts right behind the first one the budget cuts short go before it, as
    many as finish within half of what is left there. So a chat turn behind a long prompt is fed at once
    instead of waiting out the long one's chunks (a second or more on a CPU: tools/bench_behind_prompt.py;
    vLLM's partial prefills), the long one keeps at least half, every prompt fed comes before every one
    that waits (iteration-level FCFS), and a prompt that fits is never cut for a later one."""
    if left is None:
        return prompts
    for i, req in enumerate(prompts):
        if req.prompt_left > left:
            quick, j = left // 2, i + 1
            while j < len(prompts) and prompts[j].prompt_left <= quick:
                quick -= prompts[j].prompt_left
                j += 1
            return [*prompts[:i], *prompts[i + 1:j], req, *prompts[j:]]
        left -= req.prompt_left
    return prompts


class Scheduler:
    """What every policy shares: the pool, KV blocks, iterations in flight, finishing."""

    swaps_kv: ClassVar[bool] = False       # plans carry KV offloads/uploads: workers copy them on their own thread
    needs_profile: ClassVar[bool] = False  # it times this engine's iterations (`profiler()`) before serving
    plans_ahead: ClassVar[bool] = False    # its batches may be planned before the last tokens return (async scheduling)

    def __init__(self, cfg: "Config", info: "ModelInfo") -> None:
        self.max_bs = cfg.scheduler.max_bs
        self.token_budget = cfg.scheduler.max_num_batched_tokens  # 0: no budget, whole prompts (ORCA)
        self.client_rows = client_rows(cfg)  # a client's rows an iteration past any other client's (0: no cap)
        self.turn_waits = 0   # rows client_rows made wait an iteration, so far
        self.n_workers = cfg.engine.n_workers
        # prefix hashes are seeded with what besides the tokens changes K/V: the model and its dtype
        seed = chain_seed(info.path, info.arch, resolve_dtype(cfg.model.dtype, cfg.engine.device)) if cfg.engine.prefix_caching else None
        self.block_manager = BlockManager(PoolSize.from_config(cfg), seed, host=self.swaps_kv, window=info.kv_window)
        self.finished: OrderedDict[str, dict[str, Any]] = OrderedDict()   # metrics of the last KEPT_METRICS finished
        self.eos_token_ids = set(info.eos_token_ids)
        self.pool: dict[str, Request] = {}            # insertion order = arrival order
        self.pool_changes = 0                         # requests that joined or left it: what a cached order is of
        self.in_flight: dict[int, list[Request]] = {}
        self.released: list[str] = []   # ended requests whose token history the last stage drops (the next plan's)
        self.iteration = 0
        self.record: deque[tuple[int, list[str]]] = deque(maxlen=RECORD_WINDOW)  # (iteration, request ids) for FCFS checks
        self.profile: IterationProfile | None = None   # this engine's iteration times, for policies that need them
        self.profile_max_len = profile_max_len(cfg, info)
        self.probes: Profiler | None = None   # the policy's probe iterations, while they are timed
        self.held: dict[str, Request] = {}    # requests that arrived before the profile
        self.profiled = not self.needs_profile
        if self.max_bs < 1 or self.n_workers < 1 or self.token_budget < 0:
            raise ValueError("max_bs and n_workers must be >= 1, max_num_batched_tokens >= 0")
        # async scheduling: one iteration more in flight, planned while the one before computes
        self.ahead = async_scheduling(cfg, type(self))
        self.depth = self.n_workers + self.ahead
        self.max_len = info.max_model_len(cfg)
        self.speculator = Speculator(cfg.speculative, self.token_budget) if cfg.speculative.method != "off" else None
        self.plan_budget = cfg.structured.plan_budget or None   # matcher calls an iteration may spend planning closings
        self.max_pooled = max_pooled_rows(info.hidden_size)   # embedding rows an iteration may pool
        # the columnar planner's store (sched/columns.py); None: every iteration takes the general path
        self.columns = DecodeColumns(np.array(sorted(self.eos_token_ids), np.int64)) if self.speculator is None and not self.block_manager.window else None
        # iterations in flight with decode rows it planned: their slots and ids, `ended` then, and their plan rows (None: all)
        self.columnar: dict[int, tuple[np.ndarray, list[str], int, list[int] | None]] = {}
        self.ended = 0   # requests that finished or were asked to abort while running, so far
        self.retiring: list[Request] | None = None   # while a result applies: the requests it finished (`apply`)

    # ------------------------------------------------------------ the iteration loop

    def step(self, now: float, results: Sequence[IterationResult] = ()) -> StepOutput:
        """One turn of the loop: apply the returned iterations (tokens, finishes, preemption), then
        plan iterations while fewer than n_workers are in flight (ORCA §4.2: one per pipeline
        stage). A policy that needs this engine's iteration profile first times its probe
        iterations, one at a time, through this same loop; requests arriving meanwhile wait."""
        out = StepOutput()
        for result in results:
            if self.probes is not None and self.probes.owns(result.iteration):
                if (profile := self.probes.finish(now)) is not None:
                    self.use_profile(profile)
            else:
                out.tokens.extend(self.apply(result, now))
        if not self.profiled and self.probes is None:
            self.probes = self.profiler()
        while len(self.in_flight) < (self.n_workers if self.probes is not None else self.depth):
            plan = self.probes.next_plan(now) if self.probes is not None else self.schedule(now)
            if plan is None:
                break
            out.plans.append(plan)
        return out

    # ------------------------------------------------------------ pool

    def add(self, req: Request) -> None:
        if req.request_id in self.pool or req.request_id in self.held:
            raise ValueError(f"duplicate request id {req.request_id}")
        self.check(req)
        if not self.profiled:
            self.held[req.request_id] = req
            return
        self.pool[req.request_id] = req
        self.pool_changes += 1
        if self.speculator is not None and req.pooling is None:
            self.speculator.start(req)
        if self.columns is not None:
            self.columns.add(req)
        self.enter(req)

    def abort(self, request_id: str) -> list[TokenEvent]:
        """The events the abort ends with now: its final, or none while its iteration is in
        flight (it finishes when the tokens come back) or when it is unknown."""
        if self.held.pop(request_id, None) is not None:
            return [TokenEvent(request_id, None, "abort")]
        req = self.pool.get(request_id)
        if req is None:
            return []
        if req.running:
            req.aborted = True
            self.ended += 1
            return []
        self._finish(req, "abort")
        return [TokenEvent(request_id, None, "abort")]

    def has_work(self) -> bool:
        return bool(self.pool) or bool(self.in_flight) or bool(self.held) or not self.profiled

    @property
    def n_in_flight(self) -> int:
        return len(self.in_flight)

    def expects(self, iteration: int) -> bool:
        """Whether a result for `iteration` has a plan or probe in flight to apply to (else it is stray)."""
        return iteration in self.in_flight or (self.probes is not None and self.probes.owns(iteration))

    def stats(self) -> dict[str, Any]:
        return {
            **self.block_manager.stats(), "waiting": sum(not r.running for r in self.pool.values()),
            "running": sum(r.running for r in self.pool.values()), "in_flight": len(self.in_flight),
            "iterations": self.iteration, "turn_waits": self.turn_waits, **({} if self.speculator is None else self.speculator.counters.stats()),
        }

    # ------------------------------------------------------------ iterations

    def schedule(self, now: float) -> IterationPlan | None:
        """The next iteration, or None when nothing can run (`step` keeps the pipeline's cap)."""
        chosen = self.select(now)
        selected = in_turn(chosen, self.client_rows, self.in_flight.values())
        self.turn_waits += len(chosen) - len(selected)
        if self.columns is not None and selected and (
                (steady := self.columns.kept(selected, self.ended)) is not None or decodes(selected)):   # every row a plain decode: in columns
            self.admitted(selected, now)
            self._uploaded()
            plan, d = plan_decode(self.columns, self.block_manager, selected, self.iteration, steady, self.ended)
            self.columnar[plan.iteration] = (d.slots, d.ids, self.ended, None)
            return self._planned(plan, selected, d.ids)
        planning = Budget(self.plan_budget)
        batch = closings.ready(self.fit_budget(selected), planning, idle=not self.in_flight)
        if not batch:
            return None
        self.admitted(batch, now)
        self._uploaded()
        drafts = {} if self.speculator is None else self.speculator.propose(batch, sum(r.chunk or 1 for r in batch), self.max_len)
        seqs, others = [], []   # the rows that are not plain decodes: the plain ones go in columns (`decoded`)
        plain = [] if self.columns is None else [row for row, req in enumerate(batch) if decoding(req)]
        decoded = decode_rows(self.columns, self.block_manager.block_size, self.iteration, plain, [batch[i] for i in plain],
                              whole=False) if plain else None
        grow, plain_rows = ({} if decoded is None else {plain[short[0]]: short for short in decoded.short}), set(plain)
        follows = 0
        for row, req in enumerate(batch):
            if row in grow:   # a decode row's table grows here, in plan order as the general path takes blocks
                decoded.grow(self.block_manager, grow[row])   # type: ignore[union-attr]
            if row in plain_rows:
                continue
            others.append(req)
            prev = NO_ROW
            if req.running:   # planned before its last token came back: the engine puts that token here
                tokens, start, prev, follows = [-1], req.num_tokens, req.sample_row, self.iteration
            else:
                tokens, start = req.next_tokens(req.chunk or None)
                if req.phase is Phase.INITIATION:
                    req.n_prompt_fed = start + len(tokens)
            req.draft = len(draft := drafts.get(req.request_id, ()))
            tokens = tokens + list(draft) if draft else tokens
            table = self.block_manager.ensure(req.request_id, start + len(tokens))
            p = req.params
            seqs.append(SeqWork(req.request_id, tokens, start, self.block_manager.wire(table), p.temperature, p.top_k, p.top_p, p.seed,
                                sample=not req.prompt_pending and req.pooling is None, prev_row=prev, draft=req.draft))
            req.in_flight += 1
        fill_masks(seqs, [None if r.prompt_pending else r.grammar for r in others])  # only rows that sample
        if drafts:
            Speculator.mask_drafts(seqs, others, planning)
        add_extras(seqs, others, self.eos_token_ids)   # logits processors: penalties, min_p, logit_bias, min_tokens
        ask_logprobs(seqs, others)
        ask_pooling(seqs, others)
        general = iter(seqs)
        row = 0
        for i, req in enumerate(batch):   # a row's place among the sampled positions (a verify row's: its first)
            sample, draft = (1, 0) if i in plain_rows else ((s := next(general)).sample, s.draft)
            req.planned, req.sample_row = self.iteration + 1, row if sample else NO_ROW
            row += sample * (1 + draft)
        plan = IterationPlan(self.iteration + 1, seqs, follows=follows)
        if decoded is not None:
            kept = list(zip([i for i in range(len(batch)) if i not in plain_rows], seqs))   # plan.seqs gives them back
            plan = IterationPlan(plan.iteration, None, follows=max(follows, decoded.follows), packed=merge(pack(plan), decoded, len(batch)),
                                 kept=kept)
            self.columnar[plan.iteration] = (decoded.slots, decoded.ids, self.ended, plain)
        return self._planned(plan, batch)

    def _uploaded(self) -> None:
        """The columns forget their copies of tables that came back from the host as other lists (a policy
        uploads while it selects and admits)."""
        if self.columns is not None and self.block_manager.replaced:
            for rid in self.block_manager.replaced:
                if (req := self.pool.get(rid)) is not None:
                    self.columns.forget(req)
            self.block_manager.replaced.clear()

    def _planned(self, plan: IterationPlan, batch: list[Request], ids: list[str] | None = None) -> IterationPlan:
        """The plan of the next iteration goes in flight, with the token histories to release (`ids`: the
        batch's request ids when the caller has them)."""
        self.iteration = plan.iteration
        plan.released, self.released = self.released, []
        self.in_flight[plan.iteration] = batch
        self.record.append((plan.iteration, [r.request_id for r in batch] if ids is None else ids))
        return plan

    def fit_budget(self, batch: list[Request]) -> list[Request]:
        """Sarathi-Serve's stall-free batching under a token budget (scheduler.max_num_batched_tokens):
        every increment request in the batch gets its one token first, then the prompts share what is
        left a chunk each, in `prompt_order`; a prompt left with no budget waits for a later iteration.
        Sets each request's `chunk`; a prompt fed now first takes the blocks of it that requests
        prefilling the same prefix published since it started (one that waits takes them when fed).
        The batch keeps its order."""
        phases = list(map(PHASE, batch))   # one pass in C: a burst's ramp plans 256 requests' rows an iteration
        left = self.token_budget - phases.count(Phase.INCREMENT) if self.token_budget else None
        prompts = [req for req, phase in zip(batch, phases) if phase is Phase.INITIATION]
        for req in batch:
            req.chunk = 0
        pooling = self.max_pooled   # embedding rows past it wait: an iteration's vectors stay in a frame
        for req in prompt_order(prompts, left):
            if left is not None and left <= 0:   # no budget left: the prompt waits
                break
            if req.pooling is not None:
                if not pooling:
                    continue
                pooling -= 1
            self.block_manager.reuse(req)   # a prompt fed now takes the blocks of it published since it started
            policy = self.prompt_chunk(req)
            req.chunk = req.prompt_left if policy is None else min(policy, req.prompt_left)
            if left is not None:
                req.chunk = min(req.chunk, left)
                left -= req.chunk
        # an increment's one token is counted in `left` (a finished one pools nothing)
        return [req for req, phase in zip(batch, phases) if phase is not Phase.INITIATION or req.chunk]

    def process_result(self, result: IterationResult, now: float) -> list[TokenEvent]:
        """`apply`, its tokens as events."""
        return events_of(self.apply(result, now))

    def apply(self, result: IterationResult, now: float) -> list[Tokens]:
        """A returned iteration's tokens applied (finishes, stops, failures): what the stream gets of it."""
        batch = self.in_flight.get(result.iteration)
        if batch is None or len(result.token_ids) != len(batch):
            raise ValueError(f"result of iteration {result.iteration} does not match any iteration in flight")
        del self.in_flight[result.iteration]
        parts: list[Tokens] = []
        general: Sequence[int] = range(len(batch))
        # the requests it finishes leave once it is applied, in plan order: a merged plan's decode rows apply
        # first (in columns), and the order blocks go back in is the prefix cache's LRU order
        self.retiring = []
        try:
            if (columnar := self.columnar.pop(result.iteration, None)) is not None and not (result.failed or result.verify_rows):
                slots, ids, ended, rows = columnar   # its decode rows in columns, the rest (a merged plan's) row by row
                tokens = result.token_ids
                if rows is None:
                    cols = apply_decode(self, batch, ids, tokens, slots, ended, now)
                else:
                    cols = apply_decode(self, [batch[i] for i in rows], ids, [tokens[i] for i in rows], slots, ended, now)
                if cols is not None:
                    parts.append(cols)
                    general = () if rows is None else sorted(set(general) - set(rows))
            if general:
                parts.append(self._apply_rows(batch, result, general, now))
        finally:
            retiring, self.retiring = self.retiring, None
            if len(retiring) > 1:
                place = {id(req): i for i, req in enumerate(batch)}
                retiring.sort(key=lambda req: place[id(req)])
            for req in retiring:
                self._retire(req)
        self.after_iteration(batch, now)
        return self.emit(parts)

    def _apply_rows(self, batch: list[Request], result: IterationResult, rows: Sequence[int], now: float) -> list[TokenEvent]:
        """The general path: the result's `rows` applied one by one, an event per token or final."""
        events = []
        failed = set(result.failed)
        verified = dict(zip(result.verify_rows, result.verified))
        pooled = PooledRows(result)
        for row in rows:
            req, token = batch[row], result.token_ids[row]
            req.in_flight -= 1
            drafted = req.draft   # kept until its next plan: FastServe charges the tokens it verified
            if req.phase is Phase.FINISHED:  # the request-level baseline's inactive request: compute wasted
                continue
            req.n_iterations += 1
            if req.request_id not in failed:   # its K/V is written: its full blocks join the prefix cache
                n = req.n_prompt_fed if req.prompt_pending else req.num_tokens
                # an embedding's prompt is done: the request-level baseline reruns its last position until its batch ends
                self.block_manager.computed(req, n, n - 1 if req.pooling is not None and not req.prompt_pending else None)
            if req.aborted or req.request_id in failed:  # its work failed on a worker: it ends, the batch goes on
                reason = "abort" if req.aborted else "error"
                self._finish(req, reason)
                events.append(TokenEvent(req.request_id, None, reason))
                continue
            if req.pooling is not None:   # embeddings: its chunk's pooled sum; its prompt's last chunk ends it
                if reason := pooled.add(req, row):
                    self._finish(req, reason, now)
                    events.append(TokenEvent(req.request_id, None, reason, embedding=req.embedding))
                continue
            if req.prompt_pending:  # part of its prompt still to feed: what the engine sampled is dropped
                continue
            req.phase = Phase.INCREMENT
            if req.first_token_time is None:
                req.first_token_time = now
            reason, appended = None, 0
            for token in (token, *verified.get(row, ())):   # a verify row's tokens, up to the first that ends the request
                req.output_token_ids.append(token)
                appended += 1
                if reason := self._stop_reason(req, token):
                    break
                events.append(TokenEvent(req.request_id, token))
            if req.slot >= 0:
                self.columns.appended(req)   # type: ignore[union-attr]
            if drafted:   # the K/V of the drafts it kept is its own now
                self.speculator.learn(req, drafted, appended - 1)   # type: ignore[union-attr]   # drafts past a stop count for nothing
                self.block_manager.computed(req, req.num_tokens - 1)
            if req.spec is not None:   # the blocks only rejected (or, for a grammar, cut) drafts needed go back
                self.block_manager.trim(req.request_id, req.num_tokens)
            if reason:
                self._finish(req, reason, now)
                report = {"structured_output": req.grammar.report()} if req.grammar else None
                events.append(TokenEvent(req.request_id, token, reason, report))
        if result.logprob_rows or result.prompt_rows:
            attach_logprobs(batch, result, events)
        return events

    def _stop_reason(self, req: Request, token: int) -> str | None:
        if req.grammar is not None and (reason := req.grammar.accept(token)):
            return reason
        if not req.params.ignore_eos and token in self.eos_token_ids or token in req.params.stop_token_ids:
            return "stop"
        return "length" if len(req.output_token_ids) >= req.params.max_tokens else None

    def _finish(self, req: Request, reason: str, now: float | None = None) -> None:
        req.phase, req.finish_reason, req.finish_time = Phase.FINISHED, reason, now
        self.ended += 1
        if req.grammar is not None:
            req.grammar.release()
        if self.retiring is not None:
            self.retiring.append(req)
        else:
            self._retire(req)

    def _retire(self, req: Request) -> None:
        """A finished request leaves the pool and frees its KV (and its token history on the last stage)."""
        del self.pool[req.request_id]
        self.pool_changes += 1
        self.block_manager.release(req)
        if self.columns is not None:
            self.columns.remove(req)
        if req.history_fed >= 0:
            self.released.append(req.request_id)
        self.finished[req.request_id] = self.metrics(req)
        while len(self.finished) > KEPT_METRICS:
            self.finished.popitem(last=False)
        self.release(req)

    # ------------------------------------------------------------ policy hooks

    def profiler(self) -> Profiler | None:
        """Iterations to time on the real engine before any request, when the policy needs them."""
        bm = self.block_manager
        return Profiler(bm.block_size, bm.num_blocks, self.profile_max_len, self.max_bs) if self.needs_profile else None

    def use_profile(self, profile: IterationProfile) -> None:
        """This engine's iteration times: the fitted timings of `profiler()`'s plans, or a profile
        given before the first step (nothing is probed then). Requests held until now join."""
        self.profile, self.probes, self.profiled = profile, None, True
        held, self.held = self.held, {}
        for req in held.values():
            self.add(req)

    def check(self, req: Request) -> None:
        """Refuse a request this policy can never run (raise ValueError): one whose whole KV (prompt
        and max_tokens) exceeds the device pool would wait forever for its reservation. Admission
        (`ServedModel.fit`) refuses those with a message for the client; this is the scheduler's own
        invariant, for what feeds it Requests directly (the simulator, benchmarks, tests)."""
        if self.block_manager.blocks_for(req.max_total_tokens) > self.block_manager.num_blocks:
            raise ValueError(f"request {req.request_id}: {req.max_total_tokens} tokens exceed the device KV pool")

    def selectable(self, req: Request) -> bool:
        """Idle, or running and plannable ahead: in the last iteration planned (whose tokens the engine
        keeps), decoding freely (no prompt left, no grammar that needs its token first), and that
        token not its last by length (a stop token found late costs one row of a wasted iteration), nor
        likely to propose a draft once that token is back (Speculator.will_draft)."""
        return not req.running or (
            self.ahead and req.in_flight == 1 and req.planned == self.iteration and req.phase is Phase.INCREMENT
            and req.grammar is None and not req.aborted and not req.draft
            and len(req.output_token_ids) + 2 <= req.params.max_tokens
            and not (self.speculator is not None and self.speculator.will_draft(req)))

    def enter(self, req: Request) -> None:
        """A request joined the pool (FastServe: its skip-join)."""

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

    def emit(self, parts: list[Tokens]) -> list[Tokens]:
        """What the stream gets of a result's tokens now (the request-level baseline holds them)."""
        return parts

    def metrics(self, req: Request) -> dict[str, Any]:
        """A request's scheduler metrics for its final message: its prompt tokens taken from the
        prefix cache, the iterations it took part in (its prompt's chunks and its decode or verify steps),
        and what the policy adds (FastServe: queues, swaps)."""
        return {"cached_tokens": req.cached_tokens, "iterations": req.n_iterations, **Speculator.metrics(req)}

    def final_metrics(self, event: TokenEvent) -> dict[str, Any]:
        """A final event's scheduler metrics, as the server's final message and the offline LLM's output
        carry them: the request's and what the event adds (a structured output's report)."""
        return (self.request_metrics(event.request_id) or {}) | (event.metrics or {})

    def request_metrics(self, request_id: str) -> dict[str, Any] | None:
        """A request's metrics, live or (one of the last KEPT_METRICS) finished; None if unknown."""
        if request_id in self.finished:
            return self.finished[request_id]
        req = self.pool.get(request_id)
        return None if req is None else self.metrics(req)


def ask_logprobs(seqs: list[SeqWork], batch: list[Request]) -> None:
    """The rows' log-probability asks (SeqWork.logprobs, prompt_logprobs and next_token): a
    sampling row asks for its token's, a prompt row for its positions' next tokens'."""
    for s, req in zip(seqs, batch):
        p = req.params
        if p.logprobs is None and p.prompt_logprobs is None:
            continue
        if s.sample and p.logprobs is not None:
            s.logprobs = p.logprobs
        end, prompt = s.start_pos + len(s.token_ids), req.prompt_token_ids
        if p.prompt_logprobs is not None and s.prev_row == NO_ROW and end <= len(prompt):
            s.prompt_logprobs = p.prompt_logprobs
            s.next_token = prompt[end] if end < len(prompt) else -1


def attach_logprobs(batch: list[Request], result: IterationResult, events: list[TokenEvent]) -> None:
    """An iteration's log probabilities onto its events: a prompt's positions gather on the request
    (its chunks may span iterations) until its first token's event carries them."""
    for r, entry in zip(result.prompt_rows, result.prompt_logprobs):
        req = batch[r]
        if req.prompt_logprobs is None:
            req.prompt_logprobs = entry
        else:
            req.prompt_logprobs.extend(entry)
    sampled = {batch[r].request_id: entry for r, entry in zip(result.logprob_rows, result.logprobs)}
    by_id = {req.request_id: req for req in batch}
    for e in events:
        if e.token_id is None:
            continue
        e.logprobs = sampled.get(e.request_id)
        req = by_id[e.request_id]
        if req.prompt_logprobs is not None and req.params.prompt_logprobs is not None:
            e.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
