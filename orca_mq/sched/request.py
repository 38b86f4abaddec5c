"""A request in the scheduler's pool, its lifecycle (ORCA: INITIATION -> INCREMENT -> finished) and
every policy's state of it: the state leaves with the request, so no policy keeps a map to clean up."""
from __future__ import annotations

import enum
import operator
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from orca_mq.kv.request import SwapCounts
from orca_mq.protocol.pooling import PoolingParams
from orca_mq.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from orca_mq.structured.grammar import Grammar
    from orca_mq.sched.spec_state import SpecState
    from orca_mq.protocol.iteration import Biases
    from orca_mq.protocol.logprobs import TokenLogprobs


class Phase(enum.Enum):
    INITIATION = "initiation"   # prompt not yet processed
    INCREMENT = "increment"     # one token per iteration
    FINISHED = "finished"


PHASE = operator.attrgetter("phase")   # a request's phase: mapped over a batch, one pass in C


@dataclass(slots=True)
class JobState:
    """Its place in FastServe's skip-join MLFQ (orca_mq/sched/mlfq.py), set when it joins."""
    queue: int = 0
    entered: float = 0.0            # when it entered its queue: FCFS order inside the queue
    ready_since: float = 0.0        # when it last became runnable (arrival or its iteration's return)
    attained: float = 0.0           # service received in the current queue
    budget: float = 0.0             # quantum of the current queue, + extra after a starvation promotion
    history: list[tuple[float, str, int]] = field(default_factory=list)   # (time, join|demote|promote, queue)


@dataclass(slots=True)
class Waits:
    """Its waiting under FastServe (request metrics)."""
    queued_s: float = 0.0       # arrival -> first iteration
    preempted_s: float = 0.0    # between its iterations, preempted by higher-priority jobs


@dataclass(slots=True)
class Request:
    """The KV layer reads and writes what orca_mq/kv/request.py's KVRequest names of it."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    # what a decode row reads and writes each iteration, side by side: a plan and its result touch about two
    # cache lines of the request (served, the worker's iteration between them leaves them cold)
    output_token_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.INITIATION
    in_flight: int = 0             # iterations in flight it is part of (2: async scheduling planned its next)
    planned: int = 0               # the iteration it was last planned in
    sample_row: int = -1           # and its row among that iteration's sampling rows (-1: none)
    chunk: int = 0                 # prompt tokens its latest iteration feeds (0: an increment)
    n_iterations: int = 0
    slot: int = -1                 # its row in the columnar planner's store (orca_mq/sched/columns.py; -1: none)
    aborted: bool = False          # abort asked while running: finish when its iteration returns
    kv_published: int = 0          # its leading blocks known computed (taken from, or offered to, the prefix cache)
    n_prompt_fed: int = 0          # prompt tokens given to the engine so far (all of them after one ORCA initiation)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    reserved_blocks: int = 0       # KV blocks of max_total_tokens, reserved when it starts (ORCA's n_rsrv, FastServe's admission)
    cached_tokens: int = 0         # prompt tokens whose K/V it took from the prefix cache instead of computing
    kv_hashes: list[bytes] = field(default_factory=list)   # prefix hashes of its first full blocks (orca_mq/kv/prefix.py)
    job: JobState = field(default_factory=JobState)
    waits: Waits = field(default_factory=Waits)
    swaps: SwapCounts = field(default_factory=SwapCounts)
    grammar: "Grammar | None" = None   # structured outputs: its matcher, advanced by each accepted token
    history_fed: int = -1          # penalties: prompt tokens its token history on the last stage has seen (-1: none started)
    logit_bias: Biases | None = None   # params.logit_bias as columns, parsed at its first row
    prompt_logprobs: "TokenLogprobs | None" = None   # its prompt's log probabilities so far, until its first token carries them
    spec: "SpecState | None" = None   # speculative decoding: its n-gram index and adaptive k (None: it does not speculate)
    draft: int = 0                 # draft tokens its iteration in flight verifies
    client: str = ""               # who it counts for in the pool's fair shares (orca_mq.fair_share.client_name)
    # an embedding request (orca_mq/sched/pooling.py): a prompt that samples nothing and leaves with its vector
    pooling: PoolingParams | None = None
    pooled: np.ndarray | None = None   # float64 [hidden]: the sum of its pooled rows so far...
    pooled_count: int = 0              # ...and how many tokens they cover
    embedding: bytes | None = None     # its vector (float32 bytes), once its prompt's last chunk came back

    @property
    def running(self) -> bool:
        """Part of an iteration in flight."""
        return self.in_flight > 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """ORCA's max_tokens: input tokens + max generated tokens, what the KV reservation covers (an
        embedding generates none)."""
        return len(self.prompt_token_ids) + (self.params.max_tokens if self.pooling is None else 0)

    @property
    def prompt_left(self) -> int:
        return len(self.prompt_token_ids) - self.n_prompt_fed

    @property
    def prompt_pending(self) -> bool:
        return self.n_prompt_fed < len(self.prompt_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position's logits, mean pooling every position's hidden state:
        such a request computes its whole prompt (as vLLM), though it still publishes its blocks for others."""
        return self.params.prompt_logprobs is None and not (self.pooling is not None and self.pooling.mean)

    def next_tokens(self, max_prompt_tokens: int | None = None) -> tuple[list[int], int]:
        """(tokens to feed, their start position): the rest of the prompt (or its next
        `max_prompt_tokens`) first, then the last token."""
        if self.phase is Phase.INITIATION:
            end = len(self.prompt_token_ids) if max_prompt_tokens is None else self.n_prompt_fed + max_prompt_tokens
            return self.prompt_token_ids[self.n_prompt_fed:end], self.n_prompt_fed
        return [(self.output_token_ids or self.prompt_token_ids)[-1]], self.num_tokens - 1   # an embedding has no output
