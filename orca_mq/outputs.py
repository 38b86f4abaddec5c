"""What a finished request returns, the same from the ZeroMQ client and the offline LLM, and its
metrics, made by one function for both (orca_mq.assembly, the server's frontend's and the offline LLM's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orca_mq.protocol.logprobs import Logprobs
from orca_mq.protocol.pooling import floats


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None              # "stop" | "length" | "abort" | "error"
    error: str | None = None
    metrics: dict[str, Any] | None = None  # output_metrics: token counts, timings, the scheduler's
    code: str | None = None                # with "error"/"abort": a stable code (orca_mq.protocol.common_msgs)
    prompt_token_ids: list[int] = field(default_factory=list)  # offline only: the server keeps its tokenization
    logprobs: Logprobs | None = None         # SamplingParams.logprobs: each generated token's and its top k
    prompt_logprobs: Logprobs | None = None  # SamplingParams.prompt_logprobs: each prompt token's (the first: None)
    param: str | None = None                 # with "error": the request field at fault, where one is (prompt, max_tokens, ...)


@dataclass(slots=True)
class EmbeddingOutput:
    """An embedding request's result (`embed`), the same from the ZeroMQ client and the offline LLM."""

    request_id: str
    data: bytes                            # the vector: hidden_size little-endian float32 (b"" when it failed)
    prompt_tokens: int
    finish_reason: str | None              # "stop" (embedded) | "abort" | "error"
    error: str | None = None
    code: str | None = None                # with "error"/"abort": a stable code (orca_mq.protocol.common_msgs)
    param: str | None = None               # with "error": the request field at fault, where one is (prompt, pooling)
    metrics: dict[str, Any] | None = None  # output_metrics (completion_tokens 0)

    @property
    def embedding(self) -> list[float]:
        return floats(self.data)


def output_metrics(prompt_tokens: int, completion_tokens: int, arrival: float, first_token: float | None, finish: float,
                   scheduler: dict[str, Any] | None) -> dict[str, Any]:
    """A finished request's metrics (times: wall clock, seconds), with the scheduler's under "scheduler"
    (Scheduler.final_metrics: the iterations it took part in, cached prompt tokens, speculation
    counters, a structured output's report, FastServe's queues and swaps)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "arrival_time": arrival,
        "first_token_time": first_token,
        "finish_time": finish,
        "ttft": None if first_token is None else first_token - arrival,
        "tpot": (finish - first_token) / (completion_tokens - 1) if first_token is not None and completion_tokens > 1 else None,
        "e2e_latency": finish - arrival,
    } | ({"scheduler": scheduler} if scheduler else {})
