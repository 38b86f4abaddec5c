"""The SRPT oracle: a bound to measure policies against, not a policy a server can honestly run.

It knows every request's output length: `max_tokens`, which the benchmark traces force with
`ignore_eos`. It runs the requests with the least remaining predicted work first (their prompt
still to feed, at this engine's profiled initiation time, plus one increment iteration at max_bs per
token still to generate): shortest remaining processing time, the classic optimum for mean JCT, so
no policy that does not know output lengths (FastServe's MLFQ included) can beat it on mean JCT.
KV is reserved as ORCA reserves it; a new request that does not fit is passed over, not waited for.
Labelled an oracle wherever it appears.
"""
from __future__ import annotations

from orca_mq.sched.orca import OrcaScheduler
from orca_mq.sched.registry import register
from orca_mq.sched.request import Request


@register("srpt")
class SrptOracle(OrcaScheduler):
    needs_profile = True

    def remaining(self, req: Request) -> float:
        assert self.profile is not None
        prompt = self.profile.initiation_time(req.prompt_left) if req.prompt_pending else 0.0
        return prompt + (req.params.max_tokens - len(req.output_token_ids)) * self.profile.increment_time(self.max_bs)

    def select(self, now: float) -> list[Request]:
        return self.reserve_in_order(sorted((r for r in self.pool.values() if self.selectable(r)), key=self.remaining),
                                     strict=False)
