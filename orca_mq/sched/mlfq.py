"""FastServe's skip-join multi-level feedback queue (MLFQ): priorities, quanta, ENST.

Queues Q1..Qk (index 0..k-1, 0 = highest priority) with quantum(Qi) = quantum(Q1) * ratio^(i-1).
A job's service in its queue is the predicted time of the iterations it ran there; it is demoted
once that reaches the queue's quantum. Pure bookkeeping on the caller's clock: `now` is passed in.
A job is a Request; its MLFQ state is `req.job`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from orca_mq.sched.request import JobState

if TYPE_CHECKING:
    from orca_mq.sched.request import Request


class SkipJoinMLFQ:
    def __init__(self, n_queues: int, quantum: float, ratio: float, starve_limit: float) -> None:
        if n_queues < 1 or quantum <= 0 or ratio < 1 or starve_limit <= 0:
            raise ValueError("fastserve: need n_queues >= 1, quantum > 0, quantum_ratio >= 1, starve_limit > 0")
        self.quanta = [quantum * ratio**i for i in range(n_queues)]
        self.starve_limit = starve_limit

    def skip_join_queue(self, iteration_time: float, lowest: int = 0) -> int:
        """The highest-priority queue (not above `lowest`) whose quantum covers the iteration."""
        for q in range(lowest, len(self.quanta)):
            if self.quanta[q] >= iteration_time:
                return q
        return len(self.quanta) - 1

    def join(self, req: Request, first_iteration_time: float, now: float) -> int:
        q = self.skip_join_queue(first_iteration_time)
        req.job = JobState(q, now, now, budget=self.quanta[q], history=[(now, "join", q)])
        return q

    def charge(self, req: Request, service: float, next_iteration_time: float, now: float) -> None:
        """A job's iteration returned (token-level preemption): account its service and demote it
        to the queue its next iteration fits in once the current queue's quantum is used up."""
        job = req.job
        job.attained += service
        job.ready_since = now
        if job.attained < job.budget:
            return
        q = self.skip_join_queue(next_iteration_time, min(job.queue + 1, len(self.quanta) - 1))
        if q != job.queue:  # to the tail of the lower queue; the lowest queue keeps its FCFS order
            job.entered = now
            job.history.append((now, "demote", q))
        job.queue, job.attained, job.budget = q, 0.0, self.quanta[q]

    def promote_starved(self, req: Request, next_iteration_time: float, now: float) -> bool:
        """A job below Q1 runnable for longer than starve_limit goes to the tail of Q1, where every job
        gets one quantum and drops out: so the wait after a promotion is bounded too. One
        whose next iteration exceeds Q1's quantum gets that much quantum instead, so that iteration
        runs without demotion (FastServe's extra quantum). True if it was promoted."""
        job = req.job
        if not job.queue or now - job.ready_since <= self.starve_limit:
            return False
        job.queue, job.entered, job.attained = 0, now, 0.0
        job.budget = max(self.quanta[0], next_iteration_time)
        job.history.append((now, "promote", 0))
        return True

    def order(self, reqs: list[Request]) -> list[Request]:
        """Priority order: highest queue first, FCFS inside a queue (requests come in arrival order)."""
        return sorted(reqs, key=lambda r: (r.job.queue, r.job.entered))

    def enst(self, reqs: list[Request], max_bs: int, now: float) -> dict[str, float]:
        """Estimated next scheduled time of each job (seconds from now), FastServe §4.2:
        ENST(i) = min(T_promote(i), T_execute(i)). T_promote is the time left before starvation
        promotion (none in Q1); T_execute is the service every job ahead of i still gets before i's turn,
        assuming none finishes early: the rest of its own queue's quantum plus the full quanta of the
        queues between it and i. Iterations batch max_bs jobs, so that service drains max_bs at a
        time, and a job with fewer than max_bs jobs ahead runs in the next iteration."""
        k = len(self.quanta)
        cum = [0.0]
        for qt in self.quanta:
            cum.append(cum[-1] + qt)
        count, rem = [0] * k, [0.0] * k           # jobs ahead per queue, their remaining in-queue service
        out: dict[str, float] = {}
        for n_ahead, req in enumerate(self.order(reqs)):
            job = req.job
            t_execute = 0.0
            if n_ahead >= max_bs:
                qi = job.queue
                t_execute = (rem[qi] + sum(rem[q] + count[q] * (cum[qi] - cum[q + 1]) for q in range(qi))) / max_bs
            t_promote = max(0.0, self.starve_limit - (now - job.ready_since)) if job.queue else t_execute
            out[req.request_id] = min(t_promote, t_execute)
            count[job.queue] += 1
            rem[job.queue] += max(0.0, job.budget - job.attained)
        return out
