"""ASGI wrappers at the HTTP API's edge, before FastAPI reads anything:

- `ApiKeyGuard`: with `server.api_key`, every route but /health needs `Authorization: Bearer KEY` or
  `x-api-key: KEY` (Anthropic's; one of the keys, compared in constant time); otherwise 401 with the
  route's API's error object (orca_mq.api.errors.body_for). Who a request counts for in the server's
  fair shares (`end_client`) is its key then, else its connection;
- `BodyLimit`: a declared Content-Length over the limit gets 413 at once; a chunked body is cut
  off (and refused) as soon as it passes the limit;
- `Handled`: FastAPI answers an exception with its handler (which logs it) and then re-raises it
  for the server to print; the re-raise ends here, so no traceback reaches a terminal.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException

from orca_mq.api.errors import ApiError, body_for
from orca_mq.auth import KeyCheck

Scope = dict[str, Any]
Receive = Any
Send = Any
OPEN_PATHS = frozenset({"/health"})   # a load balancer's probe needs no key
END_CLIENT = "orca_mq.end_client"


def end_client(scope: Scope) -> str:
    """The client an HTTP request counts for (Generate.on_behalf_of): the index of its key, else its connection."""
    if END_CLIENT in scope:
        return scope[END_CLIENT]
    host, port = scope.get("client") or ("?", 0)
    return f"conn:{host}:{port}"


class ApiKeyGuard:
    def __init__(self, app: Any, keys: KeyCheck) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.required or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if b"x-api-key" in headers:
            scheme, key = "bearer", headers[b"x-api-key"].decode("latin-1")
        if scheme.lower() == "bearer" and (index := self.keys.which(key.strip())) >= 0:
            scope[END_CLIENT] = f"key{index}"
            await self.app(scope, receive, send)
            return
        message = ("Incorrect API key provided." if key else
                   "You didn't provide an API key: send the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY').")
        await send_error(send, scope, ApiError(401, message, "invalid_api_key"), [(b"www-authenticate", b"Bearer")])


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
            await send_error(send, scope, self._too_large())
            return
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                # an HTTPException: FastAPI's body read passes it on to the handler (413 request_too_large);
                # any other, an ApiError too, it turns into its 400 "There was an error parsing the body"
                raise HTTPException(413, self._too_large().message)
            return msg

        await self.app(scope, limited, send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body larger than {self.limit} bytes (server.http_max_body_bytes)", "request_too_large")


class Handled:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception:  # answered (500) and logged by the API's exception handler already
            pass


async def send_error(send: Send, scope: Scope, err: ApiError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(body_for(scope["path"], err)).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
