"""A request in the scheduler's pool and its lifecycle (ORCA: INITIATION -> INCREMENT -> finished)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from orca_mq.sampling_params import SamplingParams


class Phase(enum.Enum):
    INITIATION = "initiation"   # prompt not yet processed
    INCREMENT = "increment"     # one token per iteration
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.INITIATION
    running: bool = False          # part of an iteration in flight
    aborted: bool = False          # abort asked while running: finish when its iteration returns
    n_iterations: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """ORCA's max_tokens: input tokens + max generated tokens, what the KV reservation covers."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    def next_tokens(self) -> tuple[list[int], int]:
        """(tokens to feed, their start position): the whole prompt first, then the last token."""
        if self.phase is Phase.INITIATION:
            return list(self.prompt_token_ids), 0
        return [self.output_token_ids[-1]], self.num_tokens - 1
