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
    n_prompt_fed: int = 0          # prompt tokens given to the engine so far (all of them after one ORCA initiation)
    chunk: int = 0                 # prompt tokens its latest iteration feeds (0: an increment)
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

    @property
    def prompt_left(self) -> int:
        return len(self.prompt_token_ids) - self.n_prompt_fed

    @property
    def prompt_pending(self) -> bool:
        return self.n_prompt_fed < len(self.prompt_token_ids)

    def next_tokens(self, max_prompt_tokens: int | None = None) -> tuple[list[int], int]:
        """(tokens to feed, their start position): the rest of the prompt (or its next
        `max_prompt_tokens`) first, then the last token."""
        if self.phase is Phase.INITIATION:
            end = len(self.prompt_token_ids) if max_prompt_tokens is None else self.n_prompt_fed + max_prompt_tokens
            return self.prompt_token_ids[self.n_prompt_fed:end], self.n_prompt_fed
        return [self.output_token_ids[-1]], self.num_tokens - 1
