"""Responses built off the HTTP event loop when they are heavy.

A response's weight is the log probabilities it carries plus its text (what building and
serialising it costs, and what parsing a reply for tool calls costs). A heavy one (an n = 16 answer
with top_logprobs, a prompt echoed with its log probabilities) is built on one thread of its own, so
/health and every other request's tokens keep their turns on the loop (the thread hands the GIL back
every `sys.getswitchinterval()`); a light one is built in place, cheaper than the hop. One thread:
heavy responses wait for each other, not the loop.

A serialising call holds the GIL from start to end (17 MB of n = 16 choices' log probabilities: one
153 ms call here), so a response is serialised in pieces (`parts`): a choice at a time, its log
probabilities already JSON text (orca_mq.api.logprobs) a piece of their own; the loop gets the GIL
between them. A whole response stays in those pieces, encoded one by one, to the socket
(`SlicedJSON`): joining them, or replacing in the joined text, is again one call over all of it (74 ms
for 22 MB here), and one write of it held the loop as long.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
HEAVY = 2000            # weight past which a response is built off the loop (~a few ms of building)
SLICE = 1 << 20         # bytes of a response body written in one turn of the loop
CHARS_PER_WEIGHT = 64   # characters of text that weigh as much as one log probability
BODY_BYTES_PER_WEIGHT = 16   # bytes of a request's body whose validation weighs as much (orca_mq.api.body)
_NULL = '"logprobs":null'


def weight(entries: int, chars: int) -> int:
    return entries + chars // CHARS_PER_WEIGHT


def parts(resp: BaseModel) -> Iterator[str]:
    """A response's JSON in pieces, each choice's `logprobs` (JSON text: orca_mq.api.logprobs) one."""
    choices = getattr(resp, "choices", None)
    if not choices:
        yield resp.model_dump_json(warnings=False)
        return
    resp.choices = []
    try:
        head, tail = resp.model_dump_json(warnings=False).split('"choices":[]', 1)
    finally:
        resp.choices = choices
    yield head + '"choices":['
    for i, c in enumerate(choices):
        lp, c.logprobs = c.logprobs, None
        try:
            text = c.model_dump_json(warnings=False)
        finally:
            c.logprobs = lp
        if lp is None:
            yield "," * bool(i) + text
        else:
            before, after = text.split(_NULL, 1)   # message text is escaped: the first is the field
            yield "," * bool(i) + before + '"logprobs":'
            yield lp
            yield after
    yield "]" + tail


def dump(resp: BaseModel) -> str:
    """A response's JSON (a stream's chunk: small)."""
    return "".join(parts(resp))


def encoded(resp: BaseModel) -> list[bytes]:
    """A whole response's JSON as SlicedJSON sends it."""
    return [p.encode() for p in parts(resp)]


class SlicedJSON(Response):
    """A JSON body given in pieces, written in slices of at most SLICE bytes, each its own turn of the
    loop (uvicorn waits for the socket to drain between them)."""

    media_type = "application/json"

    def __init__(self, pieces: list[bytes]) -> None:
        super().__init__(None)
        self.pieces = pieces
        self.headers["content-length"] = str(sum(map(len, pieces)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        slices = [memoryview(p)[at:at + SLICE] for p in self.pieces for at in range(0, len(p), SLICE)]
        for i, piece in enumerate(slices):
            await send({"type": "http.response.body", "body": bytes(piece), "more_body": i + 1 < len(slices)})
        if not slices:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class Builder:
    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="respond")

    async def build(self, fn: Callable[[], T], heft: int) -> T:
        """fn() here when light, else on the builder's thread."""
        if heft < HEAVY:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
