"""The error a request that cannot be served as given raises (its own module: sampling params and
structured outputs both raise it, and sampling params hold structured outputs)."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that cannot be served as given; the message names the problem, `param` the request
    field at fault where one is (`prompt`: its text, token ids or messages; `max_tokens`, ...), as
    the HTTP API's error object names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
