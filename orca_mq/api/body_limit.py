"""ASGI wrapper bounding HTTP request bodies: a declared Content-Length over the limit gets 413
at once; a chunked body is cut off (and refused) as soon as it passes the limit."""
from __future__ import annotations

import json
from typing import Any

from orca_mq.api.stream import ApiError
from orca_mq.api.schemas import error_body

Scope = dict[str, Any]
Receive = Any
Send = Any


class BodyLimit:
    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await _too_large(send, self.limit)
            return
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise ApiError(413, f"request body larger than {self.limit} bytes")
            return msg

        await self.app(scope, limited, send)


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps(error_body(413, f"request body larger than {limit} bytes")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
