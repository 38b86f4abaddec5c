"""Internal channel: frontend <-> scheduler <-> workers.

The control frame carries an iteration plan in columns (`PackedPlan`, orca_mq.protocol.iteration); the
last worker answers with the `IterationResult`. Timestamps are `time.time()` of the sending process (one host), used
only for the overhead statistics.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orca_mq.protocol.iteration import IterationResult, PackedPlan
from orca_mq.protocol.logprobs import TokenLogprobs
from orca_mq.protocol.pooling import PoolingParams
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.protocol.codec import message


@message("add")
@dataclass(slots=True)
class AddRequest:
    request_id: str               # the frontend's internal id, unique within the server (not the client's)
    prompt_token_ids: list[int]
    params: SamplingParams        # validated by the frontend, max_tokens resolved (orca_mq.admission)
    start_known: bool = False     # a constrained request's shortest plan was searched by the frontend...
    start: list[int] | None = None   # ...and is this (None: none found): the scheduler does not search again
    client: str = ""              # who it counts for in the pool's fair shares (orca_mq.fair_share.client_name)
    pooling: PoolingParams | None = None   # an embedding request: resolved by the frontend (model.pooling)


@message("abort_req")
@dataclass(slots=True)
class AbortRequest:
    request_id: str


@message("tokens", columns=("request_ids", "token_ids"), optional_columns=("logprobs",))
@dataclass(slots=True)
class TokenBatch:
    """One scheduler step's tokens, in columns and in order (request_ids[i] got token_ids[i]; a request
    may have several), and the requests that ended after their tokens here."""

    iteration: int
    request_ids: list[str]
    token_ids: list[int]
    finals: dict[str, str] = field(default_factory=dict)   # request id -> "stop" | "length" | "abort" | "error"
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # per finished request, from the policy
    # log probabilities, where requests ask: empty, or a column beside token_ids (None: not asked)...
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # ...and a prompt's, with its first token
    embeddings: dict[str, bytes] = field(default_factory=dict)   # an embedding request's vector, with its final


@message("stats_query")
@dataclass(slots=True)
class StatsQuery:
    query_id: str
    record: bool = False
    reset: bool = False


@message("stats_result")
@dataclass(slots=True)
class StatsResult:
    query_id: str
    stats: dict[str, Any]


@message("plan")
@dataclass(slots=True)
class ControlFrame:
    plan: PackedPlan
    t_sent: float


@message("result")
@dataclass(slots=True)
class IterationDone:
    result: IterationResult
    t_start: float                # last stage: compute start / end of this iteration
    t_end: float


@message("worker_stats_query")
@dataclass(slots=True)
class WorkerStatsQuery:
    query_id: str
    reset: bool = False
    record: bool = False          # include each recent iteration's shape and compute time


@message("worker_stats")
@dataclass(slots=True)
class WorkerStats:
    query_id: str
    stage: int
    stats: dict[str, Any]
