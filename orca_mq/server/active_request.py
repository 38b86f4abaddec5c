"""The frontend's state of one request: `Admission` while it is tokenized, then `ActiveRequest` once
admitted: whose it is (client, the client's own id and protocol version) and its output so far
(orca_mq.assembly: its detokenizer, which holds its tokens, and the times its final reports)."""
from __future__ import annotations

from dataclasses import dataclass

from orca_mq.assembly import Assembly
from orca_mq.protocol.client_msgs import Generate
from orca_mq.protocol.pooling import PoolingParams
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.server.held_rows import HeldRows


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
    out: Assembly             # its output so far (orca_mq.assembly: the offline LLM's too)
    version: int
    prompt_tail: str | None = None   # a chat prompt's end, until its first row is sent
    held: HeldRows | None = None     # a request that does not stream: its rows until its final
