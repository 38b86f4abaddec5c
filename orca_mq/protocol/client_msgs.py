"""Client <-> server channel (the public socket at `server.frontend_address`).

A client sends `generate` (it chooses the request_id, so it can abort before any reply; ids
belong to their client: two clients may use the same one), `abort`, `stats` and `ping`. Every request
gets exactly one final: an `output` with finished=True, or a row of an `outputs` frame with a `Final`
(finish_reason "stop" | "length" | "abort" | "error"). `error` (orca_mq.protocol.common_msgs) answers a
frame that could not be accepted at all; when it names a request_id that request is over. Error finals
carry a stable `code`.

Streaming is per iteration (protocol v4): a client whose `generate` said v4 gets one `outputs` frame
per iteration holding every one of its requests that the iteration moved. The server answers each
frame in the version the client wrote it in, so an older client (v1-v3) gets per-request `output`
frames, without the fields added after its version. Version 5 adds log probabilities (a request's
`logprobs` / `prompt_logprobs` sampling fields): `output.logprobs`, `output.prompt_logprobs` and the
same as optional columns of `outputs` (orca_mq.protocol.logprobs.Logprobs, each token's text beside its id).
Version 6 adds `generate`'s chat_template_kwargs (variables for the chat template). Version 7 adds
`output`'s param (the request field a refusal blames). Version 8 adds `generate`'s on_behalf_of: the end
client a gateway (the HTTP API) sends it for, its own client for the server's fair shares
(orca_mq.fair_share). Version 9 adds `generate`'s tools (the chat template renders them) and, with a
chat request's first tokens, the end of its rendered prompt (`prompt_tail`: whether it left a thinking block open, for a reasoning parser).
Version 10 adds embeddings: a `generate` with `pooling`
(orca_mq.protocol.pooling.PoolingParams' fields) embeds its prompt instead of generating, and its final
carries the vector (`output.embedding`, a column of `outputs`: little-endian float32 bytes, hidden_size
x 4 of them); an older client's frame cannot hold `pooling` (refused, naming the version it needs).
Version 11 adds `generate`'s stream: False sends the request's first row at once and holds the rest at
the server, sent with its final or each time they reach a bound (orca_mq.server.held_rows), as SGLang
sends a request that does not stream at its end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orca_mq.protocol.codec import added, channel, message
from orca_mq.protocol.common_msgs import Error
from orca_mq.protocol.logprobs import Logprobs


@message("generate")
@dataclass(slots=True)
class Generate:
    request_id: str
    prompt: str | None = None                       # raw completion text, or the user message with chat
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None    # chat messages; the frontend applies the template
    chat: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields; unknown ones are rejected
    api_key: str = added(3, default="")   # one of server.api_key's keys, when the server has any
    # more variables for the chat template (vLLM's), e.g. {"enable_thinking": False}; orca_mq.admission.prompts bounds them
    chat_template_kwargs: dict[str, Any] | None = added(6, default=None)
    on_behalf_of: str = added(8, default="")   # a gateway's end client (at most 256 characters): a client of its own
    tools: list[dict[str, Any]] | None = added(9, default=None)   # OpenAI's function tools, for the chat template
    # an embedding request (PoolingParams' fields; {} for the server's defaults): a prompt in, a vector out
    pooling: dict[str, Any] | None = added(10, default=None)
    # False: after its first row the server holds the request's rows for its final or a bound (a client that
    # reads only the end: its tokens cost no frame through the broker each iteration)
    stream: bool = added(11, default=True)


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
    api_key: str = added(3, default="")   # as Generate's


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
    code: str | None = added(2, default=None)   # a common_msgs code on an "error" or "abort" final
    logprobs: Logprobs | None = added(5, default=None)          # token_ids' log probabilities, when asked
    prompt_logprobs: Logprobs | None = added(5, default=None)   # the prompt's, with the first tokens, when asked
    param: str | None = added(7, default=None)   # a refusal's request field at fault, where one is (InvalidRequest.param)
    prompt_tail: str | None = added(9, default=None)   # a chat prompt's end (admission.prompts.PROMPT_TAIL_CHARS), with its first tokens
    embedding: bytes | None = added(10, default=None)   # an embedding request's final: its vector (float32, little-endian)


@dataclass(slots=True)
class Final:
    """How a request ended, in a row of `outputs`: what a final `output` says beside its tokens."""

    finish_reason: str                    # "stop" | "length" | "abort" | "error"
    error: str | None = None
    metrics: dict[str, Any] | None = None
    code: str | None = None               # a common_msgs code on an "error" or "abort" final


@message("outputs", since=4, columns=("request_ids", "token_ids", "texts", "finals"),
         optional_columns=("logprobs", "prompt_logprobs", "prompt_tails", "embeddings"))
@dataclass(slots=True)
class Outputs:
    """One iteration's news for one client, a row per request it moved: request_ids[i] got
    token_ids[i] and texts[i], and ended with finals[i] unless that is None."""

    request_ids: list[str]
    token_ids: list[list[int]]
    texts: list[str]
    finals: list[Final | None]
    # v5, where a row asks: empty (no row has any) or a column (None in the rows without)
    logprobs: list[Logprobs | None] = added(5, default_factory=list)
    prompt_logprobs: list[Logprobs | None] = added(5, default_factory=list)
    prompt_tails: list[str | None] = added(9, default_factory=list)   # v9: as logprobs, where a row has one
    embeddings: list[bytes | None] = added(10, default_factory=list)   # v10: the embedding requests' vectors

    def rows(self) -> list[Output]:
        """Each row as the `output` frame it stands for (and an older client reads)."""
        outs = [as_output(*row) for row in zip(self.request_ids, self.token_ids, self.texts, self.finals)]
        for out, lp in zip(outs, self.logprobs):
            out.logprobs = lp
        for out, lp in zip(outs, self.prompt_logprobs):
            out.prompt_logprobs = lp
        for out, tail in zip(outs, self.prompt_tails):
            out.prompt_tail = tail
        for out, vector in zip(outs, self.embeddings):
            out.embedding = vector
        return outs


def events(msg: Any) -> list[Any]:
    """A message to a client as per-request events: an `outputs` frame's rows as `output`s, any other as it is."""
    return msg.rows() if isinstance(msg, Outputs) else [msg]


def as_output(request_id: str, token_ids: list[int], text: str, final: Final | None) -> Output:
    if final is None:
        return Output(request_id, token_ids, text)
    return Output(request_id, token_ids, text, True, final.finish_reason, final.error, final.metrics, final.code)


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
TO_CLIENT = channel(Output, Outputs, StatsReply, Pong, Error)

__all__ = ["Abort", "Error", "Final", "Generate", "Output", "Outputs", "Ping", "Pong", "Stats", "StatsReply", "TO_CLIENT",
           "TO_SERVER", "as_output", "events"]
