"""Client <-> server channel (the public socket at `server.frontend_address`).

A client sends `generate` (it chooses the request_id, so it can abort before any reply; ids
belong to their client: two clients may use the same one), `abort`, `stats` and `ping`; every request gets exactly one final `output` (finished=True,
finish_reason "stop" | "length" | "abort" | "error"). `error` (orca_mq.protocol.common_msgs) answers a frame that could not be accepted at all;
when it names a request_id that request is over. Error finals carry a stable `code`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orca_mq.protocol.codec import channel, message
from orca_mq.protocol.common_msgs import Error


@message("generate")
@dataclass(slots=True)
class Generate:
    request_id: str
    prompt: str | None = None                       # raw completion text, or the user message with chat
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None    # chat messages; the frontend applies the template
    chat: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields; unknown ones are rejected
    api_key: str = ""       # protocol v3: one of server.api_key's keys, when the server has any


@message("abort")
@dataclass(slots=True)
class Abort:
    request_id: str


@message("stats")
@dataclass(slots=True)
class Stats:
    query_id: str
    record: bool = False    # include the scheduler's iteration record and arrival order (tests)
    reset: bool = False     # restart the timing windows after answering (benchmarks)
    api_key: str = ""       # protocol v3: as Generate's


@message("ping")
@dataclass(slots=True)
class Ping:
    nonce: int


@message("output")
@dataclass(slots=True)
class Output:
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    metrics: dict[str, Any] | None = None
    code: str | None = None       # protocol v2: a common_msgs code on an "error" or "abort" final


@message("stats_reply")
@dataclass(slots=True)
class StatsReply:
    query_id: str
    stats: dict[str, Any]


@message("pong")
@dataclass(slots=True)
class Pong:
    nonce: int
    server: str = ""      # the broker's instance: a new one means the server restarted
    restarts: int = 0     # restarts of the engine side since the launcher started


TO_SERVER = channel(Generate, Abort, Stats, Ping)
TO_CLIENT = channel(Output, StatsReply, Pong, Error)

__all__ = ["Abort", "Error", "Generate", "Output", "Ping", "Pong", "Stats", "StatsReply", "TO_CLIENT", "TO_SERVER"]
