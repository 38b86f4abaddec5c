"""What a scheduler step gives the stream: each applied result's tokens and finals, in order.

A result the general path applies gives a TokenEvent per token. A columnar iteration (sched/columns.py)
gives its tokens as two columns that already exist (TokenColumns: the plan's list of ids, the result's
of tokens; shared, never written) and an event only for the rows that ended: at a large batch an object
per token is the stream's largest cost on the scheduler, and the frame the frontend receives (TokenBatch)
is columns anyway.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from orca_mq.protocol.iteration import IterationPlan
    from orca_mq.protocol.logprobs import TokenLogprobs


@dataclass(slots=True)
class TokenEvent:
    request_id: str
    token_id: int | None            # None on a final event that carries no new token (abort)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" when the request is done
    metrics: dict[str, Any] | None = None  # on a final event: what the final message reports (structured outputs)
    logprobs: "TokenLogprobs | None" = None         # the token's log probabilities, when its request asks
    prompt_logprobs: "TokenLogprobs | None" = None  # on its first token: its prompt's, positions 1.. (prompt_logprobs)
    embedding: bytes | None = None  # an embedding request's final: its vector (orca_mq/protocol/pooling.py)


@dataclass(slots=True)
class TokenColumns:
    """A columnar iteration's tokens: row i's request request_ids[i] got token_ids[i]; `finals` holds the
    event of each row whose token ended its request (by row)."""
    request_ids: list[str]
    token_ids: list[int]
    finals: dict[int, TokenEvent] = field(default_factory=dict)

    def events(self) -> list[TokenEvent]:
        finals = self.finals
        return [finals.get(i) or TokenEvent(rid, t) for i, (rid, t) in enumerate(zip(self.request_ids, self.token_ids))]


Tokens: TypeAlias = "list[TokenEvent] | TokenColumns"   # one applied result's (or an abort's) tokens and finals


def events_of(parts: list[Tokens]) -> list[TokenEvent]:
    """The parts as one event per token, in order (tests', simulators' and policies' view)."""
    return [e for p in parts for e in (p.events() if isinstance(p, TokenColumns) else p)]


def n_rows(parts: list[Tokens]) -> int:
    return sum(len(p.token_ids) if isinstance(p, TokenColumns) else len(p) for p in parts)


@dataclass(slots=True)
class StepOutput:
    plans: "list[IterationPlan]" = field(default_factory=list)   # to run now, in this order
    tokens: list[Tokens] = field(default_factory=list)          # tokens and finals to stream, in order

    @property
    def events(self) -> list[TokenEvent]:
        return events_of(self.tokens)
