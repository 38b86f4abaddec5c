"""The frontend's state of one request: `Admission` while it is tokenized, then `ActiveRequest` once
admitted: whose it is (client, the client's own id and protocol version), its detokenizer (which
holds its tokens so far) and the timestamps its final message reports."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orca_mq.detokenizer import IncrementalDetokenizer
from orca_mq.outputs import output_metrics
from orca_mq.protocol.client_msgs import Generate
from orca_mq.protocol.pooling import PoolingParams
from orca_mq.protocol.sampling import SamplingParams


@dataclass(slots=True)
class Admission:
    client: bytes
    msg: Generate
    params: SamplingParams    # parsed and validated once, before tokenizing
    version: int              # the protocol version of its `generate`: every reply is written in it
    pooling: PoolingParams | None = None   # an embedding request's (resolved, model.pooling by default)
    aborted: bool = False     # an abort arrived while it was tokenized


@dataclass(slots=True)
class ActiveRequest:
    client: bytes
    request_id: str           # the client's id; the scheduler knows the request by the frontend's internal one
    detok: IncrementalDetokenizer
    prompt_tokens: int
    arrival: float
    version: int
    first_token: float | None = None
    prompt_head: int | None = None   # prompt logprobs asked: its prompt's first token, until they are sent
    prompt_tail: str | None = None   # a chat prompt's end, until its first row is sent

    def step(self, new_ids: list[int], now: float, hide_last: bool = False) -> str:
        """Take an iteration's new tokens (received at `now`); return their new text (without the last
        one when `hide_last`: the EOS that ended it)."""
        if new_ids and self.first_token is None:
            self.first_token = now
        return self.detok.step(new_ids, hide_last)

    def metrics(self, now: float, scheduler: dict[str, Any] | None) -> dict[str, Any]:
        """The final message's metrics, as it finishes at `now` (`scheduler`: the scheduler's for it)."""
        return output_metrics(self.prompt_tokens, len(self.detok.ids), self.arrival, self.first_token, now, scheduler)
