"""What a finished request returns, the same from the ZeroMQ client and the offline LLM."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orca_mq.protocol.logprobs import Logprobs


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None              # "stop" | "length" | "abort" | "error"
    error: str | None = None
    metrics: dict[str, Any] | None = None  # server-side timings and token counts (client), None offline
    code: str | None = None                # with "error"/"abort": a stable code (orca_mq.protocol.common_msgs)
    prompt_token_ids: list[int] = field(default_factory=list)  # offline only: the server keeps its tokenization
    logprobs: Logprobs | None = None         # SamplingParams.logprobs: each generated token's and its top k
    prompt_logprobs: Logprobs | None = None  # SamplingParams.prompt_logprobs: each prompt token's (the first: None)
