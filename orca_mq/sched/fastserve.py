"""FastServe: skip-join MLFQ with preemption at token granularity and proactive KV offload/upload.

The policy over the shared Scheduler base (base.py):
* add: skip-join, a job enters the highest queue whose quantum covers its predicted first
  (initiation) iteration, from the start-up profile (profiler.py).
* select: starved jobs go to Q1; then the highest-priority jobs, FCFS inside a queue, up to max_bs,
  each with its KV placed on the device by the KV policy (orca_mq/kv/policy.py; `select_batch`).
* after_iteration: every job of the iteration is preempted back to its queue and charged the
  predicted time of the iteration it ran; one that used its queue's quantum is demoted.
* schedule: the plan carries the KV policy's offloads/uploads, which every stage applies first.
A job's state (MLFQ place, waits, swaps) lives on its Request; `metrics(req)` adds it to the
scheduler's report of a request (base.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orca_mq.engine.dtype import DTYPE_BYTES, resolve_dtype
from orca_mq.protocol.iteration import IterationPlan
from orca_mq.kv.policy import KV_POLICIES, DeferKV
from orca_mq.logs import role_logger
from orca_mq.sched.lengths import OutputLengths
from orca_mq.sched.mlfq import SkipJoinMLFQ
from orca_mq.sched.profiler import IterationProfile
from orca_mq.sched.registry import register
from orca_mq.sched.base import Scheduler
from orca_mq.sched.request import Phase, Request

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.models.info import ModelInfo


def select_batch(kv: DeferKV, order: list[Request], enst: dict[str, float], max_bs: int, reserve: int,
                 budget: int | None = None) -> list[Request]:
    """The batch: jobs in priority order, up to max_bs, each resident for this iteration (made
    resident by this plan if need be, by the KV policy: started, or uploaded). A new job may not start
    ahead of an earlier one that is waiting for room, new or on the host: big jobs are not starved by
    small ones, nor a preempted job (promoted to Q1 at the latest) by a stream of arrivals. Under a
    token budget a prompt the budget cannot feed any more is passed over, so that decodes fill the
    batch: arrivals never take the running jobs' places for nothing. `reserve`: the device blocks the
    policy keeps unreserved ahead of time (`free_target`)."""
    batch: list[Request] = []
    taken: set[str] = set()
    admitting = True
    for i, req in enumerate(order):
        if len(batch) == max_bs:
            break
        if kv.waits(req) or (budget is not None and budget <= 0 and req.prompt_pending):
            continue
        if not kv.resident(req):
            new = not kv.on_host(req)
            if new and not admitting:
                continue
            if not kv.admit(req, order[i + 1:], taken, enst):
                admitting = False   # new or preempted to the host, no later new job takes the room it waits for
                continue
        taken.add(req.request_id)
        batch.append(req)
        if budget is not None:
            budget -= min(req.prompt_left, budget) if req.prompt_pending else 1
    if batch:  # swaps ride on a plan: none without one
        kv.ahead_of_time(order, taken, enst, reserve)
    return batch


@register("fastserve")
class FastServeScheduler(Scheduler):
    swaps_kv = True
    needs_profile = True

    def __init__(self, cfg: "Config", info: "ModelInfo", profile: IterationProfile | None = None) -> None:
        super().__init__(cfg, info)
        fs, eng = cfg.fastserve, cfg.engine
        if fs.kv_policy not in KV_POLICIES:
            raise ValueError(f"fastserve.kv_policy must be one of {sorted(KV_POLICIES)}, got {fs.kv_policy!r}")
        if fs.min_free_blocks < 0 or fs.burst_queues < 0 or fs.preempt_margin < 0:
            raise ValueError("fastserve.min_free_blocks, fastserve.burst_queues and fastserve.preempt_margin must be >= 0")
        self.fs = fs
        self.kv = KV_POLICIES[fs.kv_policy](self.block_manager, self, fs.preempt_margin)
        self.lengths = OutputLengths(info.max_model_len(cfg), fs.length_window, fs.prior_jobs)
        dtype = resolve_dtype(cfg.model.dtype, eng.device)
        self.block_bytes = 2 * info.n_layers * eng.block_size * info.n_kv_heads * info.head_dim * DTYPE_BYTES[dtype]
        self.log = role_logger("scheduler")
        self._set_quanta(IterationProfile.estimate(info, dtype))   # a stand-in until the measured one
        if profile is not None:
            self.use_profile(profile)

    def use_profile(self, profile: IterationProfile) -> None:
        """Predict iteration times from `profile` (measured by the probes of `profiler()`)."""
        if self.pool:
            raise RuntimeError("the iteration profile must be set before any request arrives")
        self._set_quanta(profile)
        super().use_profile(profile)

    def _set_quanta(self, profile: IterationProfile) -> None:
        """Q1's quantum is one increment iteration at max_bs unless fastserve.quantum sets it."""
        self.profile = profile
        q1 = self.fs.quantum or profile.increment_time(self.max_bs)
        self.mlfq = SkipJoinMLFQ(self.fs.n_queues, q1, self.fs.quantum_ratio, self.fs.starve_limit)
        self.log.info("fastserve quanta", quanta_s=[round(q, 4) for q in self.mlfq.quanta], kv_policy=self.fs.kv_policy)

    def remaining_s(self, req: Request) -> float:
        """Its expected remaining service: its prompt still to feed, then its expected remaining tokens."""
        prompt = self.profile.initiation_time(req.prompt_left) - self.profile.increment_time(1) if req.prompt_pending else 0.0
        return max(0.0, prompt) + self._decode_s(len(req.output_token_ids))

    def new_job_s(self) -> float:
        """A new job's expected service, its prompt aside."""
        return self._decode_s(0)

    def _decode_s(self, attained: int) -> float:
        """The expected remaining tokens after `attained` (the learned law of output lengths), at one
        increment iteration at max_bs each."""
        return self.lengths.expected_remaining(attained) * self.profile.increment_time(self.max_bs)

    def next_iteration_time(self, req: Request) -> float:
        """Its next iteration: the next prompt chunk (the whole prompt without a token budget), or an increment."""
        if req.prompt_pending:
            return self.profile.initiation_time(min(req.prompt_left, self.token_budget or req.prompt_left))
        return self.profile.increment_time(self.max_bs)

    # ------------------------------------------------------------ pool

    def enter(self, req: Request) -> None:
        q = self.mlfq.join(req, self.next_iteration_time(req), req.arrival)
        self.log.debug("skip-join", request_id=req.request_id, queue=q + 1, prompt=len(req.prompt_token_ids))

    def release(self, req: Request) -> None:
        if req.pooling is None and self.lengths.observe(len(req.output_token_ids), req.finish_reason in ("stop", "length")):
            self.lengths.refresh(len(r.output_token_ids) for r in self.pool.values())
        self.log.info("fastserve request done", request_id=req.request_id, finish_reason=req.finish_reason,
                      **self.finished[req.request_id])

    # ------------------------------------------------------------ iterations

    def schedule(self, now: float) -> IterationPlan | None:
        plan = super().schedule(now)
        if plan is not None:
            plan.swap_out, plan.swap_in = self.kv.take_swaps()
            if plan.swap_out or plan.swap_in:
                self.log.debug("kv swap", iteration=plan.iteration, offload_blocks=len(plan.swap_out),
                               upload_blocks=len(plan.swap_in))
        return plan

    def select(self, now: float) -> list[Request]:
        idle = [r for r in self.pool.values() if not r.running]
        for req in idle:
            if self.mlfq.promote_starved(req, self.next_iteration_time(req), now):
                self.log.debug("starvation promotion", request_id=req.request_id, queue=1)
        enst = self.mlfq.enst(list(self.pool.values()), self.max_bs, now)
        return select_batch(self.kv, self.mlfq.order(idle), enst, self.max_bs, self.free_target(), self.token_budget or None)

    def admitted(self, batch: list[Request], now: float) -> None:
        for req in batch:
            waited = now - req.job.ready_since
            if req.n_iterations:
                req.waits.preempted_s += waited
            else:
                req.waits.queued_s += waited

    def free_target(self) -> int:
        """Device blocks kept unreserved: max(K, burst). A burst of arrivals skip-joins the top queues,
        so the burst predictor is the reservations of the jobs there that are not resident (new or
        offloaded): what they need to run."""
        bm, burst = self.block_manager, 0
        for req in self.pool.values():
            if req.job.queue < self.fs.burst_queues and not self.kv.resident(req):
                burst += bm.blocks_for(req.max_total_tokens)
        return max(self.fs.min_free_blocks, burst)

    def after_iteration(self, batch: list[Request], now: float) -> None:
        """Token-level preemption: each job returns to its queue, charged the predicted time of its
        iteration (its prompt chunk, or an increment at this batch size, once per token it verified)."""
        for req in batch:
            if req.phase is Phase.FINISHED:
                continue
            service = (self.profile.initiation_time(req.chunk) if req.chunk
                       else self.profile.increment_time(len(batch)) * (1 + req.draft))
            queue = req.job.queue
            self.mlfq.charge(req, service, self.next_iteration_time(req), now)
            if req.job.queue != queue:
                self.log.debug("demotion", request_id=req.request_id, queue=req.job.queue + 1)

    # ------------------------------------------------------------ metrics

    def metrics(self, req: Request) -> dict[str, Any]:
        job, waits, swaps = req.job, req.waits, req.swaps
        kinds = [kind for _, kind, _ in job.history]
        return {
            **super().metrics(req),
            "queue_history": [[round(t, 6), kind, q + 1] for t, kind, q in job.history],   # queues numbered Q1..Qk
            "join_queue": job.history[0][2] + 1, "demotions": kinds.count("demote"), "promotions": kinds.count("promote"),
            "queued_s": waits.queued_s, "preempted_s": waits.preempted_s,
            "offloads": swaps.offloads, "uploads": swaps.uploads,
            "offload_bytes": swaps.offload_blocks * self.block_bytes, "upload_bytes": swaps.upload_blocks * self.block_bytes,
        }

    def stats(self) -> dict[str, Any]:
        queues = [0] * len(self.mlfq.quanta)
        for req in self.pool.values():
            queues[req.job.queue] += 1
        return {**super().stats(), **self.block_manager.host_stats(), "queue_lengths": queues}
