"""The request-level baseline the ORCA paper compares against (Triton dynamic batcher + FasterTransformer)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from orca_mq.sched.events import TokenEvent, Tokens, events_of
from orca_mq.sched.orca import OrcaScheduler
from orca_mq.sched.registry import register
from orca_mq.sched.request import Phase, Request

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.models.info import ModelInfo


@register("request")
class RequestLevelScheduler(OrcaScheduler):
    """The baseline (Triton dynamic batcher + FasterTransformer): a batch runs until every request
    in it finishes; nothing joins meanwhile and nothing returns early. As the ORCA paper describes
    (§2.2, Fig. 3), the engine keeps computing the batch's *inactive* (finished) requests until
    the batch ends: each reruns its last position, so its KV stays within its reservation, and
    the tokens are dropped. An aborted request leaves at once. And as §6.2 describes, the batch's
    first iteration processes every prompt as if it were as long as the shortest one; the rest of
    a longer prompt goes in one token an iteration, its samples dropped, before it generates."""

    plans_ahead = False   # a batch's next iteration waits for its tokens (it keeps finished rows running)

    def __init__(self, cfg: "Config", info: "ModelInfo") -> None:
        super().__init__(cfg, info)
        self.token_budget = 0                   # the baseline feeds prompts its own way, never chunked by a budget
        self.client_rows = 0                    # and runs its batch whole, whoever sent it
        self.batch: list[Request] = []
        self.batch_input_len = 0                # the batch's shortest prompt
        self.inactive: dict[str, Request] = {}  # finished, still computed, KV held until the batch ends
        self.held_tokens: list[Tokens] = []   # the batch's tokens and finals, until it ends

    def select(self, now: float) -> list[Request]:
        if not self.batch:
            self.batch = super().select(now)
            self.batch_input_len = min((len(r.prompt_token_ids) for r in self.batch), default=0)
        return [r for r in self.batch if not r.running and (r.phase is not Phase.FINISHED or r.request_id in self.inactive)]

    def prompt_chunk(self, req: Request) -> int | None:
        return max(1, self.batch_input_len - req.n_prompt_fed) if req.n_iterations == 0 else 1   # less its cached prefix

    def abort(self, request_id: str) -> list[TokenEvent]:
        if request_id in self.inactive:
            return []  # already finished: its final message is held for the batch's end
        if not any(r.request_id == request_id for r in self.batch):
            return super().abort(request_id)
        return events_of(self.emit([super().abort(request_id)]))   # a member's final waits for the batch's end, which it may be

    def _retire(self, req: Request) -> None:
        """A batch member that finished with its tokens stays in the pool, inactive, until the batch
        ends; one aborted or failed leaves at once (a failed one has nothing to recompute)."""
        if req.finish_reason not in ("abort", "error") and any(r is req for r in self.batch):
            self.inactive[req.request_id] = req
        else:
            super()._retire(req)

    def emit(self, parts: list[Tokens]) -> list[Tokens]:
        """Finals are held until the whole batch has finished (no early return); then the inactive
        members leave and the next batch may start."""
        self.held_tokens += parts
        if any(r.phase is not Phase.FINISHED for r in self.batch):
            return []
        for req in self.inactive.values():
            super()._retire(req)
        self.batch, self.inactive, out, self.held_tokens = [], {}, self.held_tokens, []
        return out
