"""Constrained requests' closing plans, prepared before an iteration is built, within its planning
budget (structured.plan_budget matcher calls; orca_mq.structured.budget): a request whose planning
does not fit sits the iteration out and its walk goes on at the next, so one request's planning
costs the others at most the budget per iteration, and itself its own latency."""
from __future__ import annotations

from orca_mq.sched.request import Phase, Request
from orca_mq.structured.budget import Budget


def samples(req: Request) -> bool:
    """Whether its row samples in the iteration being built (its chunk set: Scheduler.fit_budget)."""
    return req.phase is Phase.INCREMENT or req.chunk >= req.prompt_left


def ready(batch: list[Request], budget: Budget, idle: bool) -> list[Request]:
    """The batch less the sampling rows whose grammar's plan is not ready within `budget`. `idle`: no
    iteration is in flight, so without them none would run (and none would come back to plan the
    next): their planning is finished now, unbounded."""
    kept = [r for r in batch if r.grammar is None or not samples(r) or r.grammar.prepare(budget)]
    if kept or not idle:
        return kept
    for r in batch:
        if r.grammar is not None and samples(r):
            r.grammar.prepare(None)
    return batch
