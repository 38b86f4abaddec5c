"""Messages every channel uses: `error`, with a stable machine-readable code.

A client branches on `code`; `error` is a plain sentence for people. Internal details (pids,
exit codes, tracebacks) go to the logs, never into either.
"""
from __future__ import annotations

from dataclasses import dataclass

from orca_mq.protocol.codec import added, message

# the stable error codes (Error.code, and Output.code on a final that is neither "stop" nor "length")
INVALID_REQUEST = "invalid_request"   # the request cannot be served as given; do not retry it unchanged
OVERLOADED = "overloaded"             # too many requests waiting (server.max_waiting); retry later
UNAVAILABLE = "unavailable"           # the server is shutting down or lost a process
INTERNAL = "internal"                 # the server failed on this request; others continue
PROTOCOL = "protocol"                 # the frame could not be decoded or is not accepted here
ABORTED = "aborted"                   # the request was aborted (by its client, or by a drain timeout)
UNAUTHORIZED = "unauthorized"         # protocol v3: no valid API key (server.api_key); nothing was served
CODES = frozenset({INVALID_REQUEST, OVERLOADED, UNAVAILABLE, INTERNAL, PROTOCOL, ABORTED, UNAUTHORIZED})


@message("error")
@dataclass(slots=True)
class Error:
    error: str
    request_id: str | None = None
    code: str = added(2, default=INTERNAL)    # a v1 frame without it decodes as "internal"
