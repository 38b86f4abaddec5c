"""Responses built off the HTTP event loop when they are heavy.

A response's weight is the log probabilities it carries plus its text (what building and
serialising it costs, and what parsing a reply for tool calls costs). A heavy one (an n = 16 answer
with top_logprobs, a prompt echoed with its log probabilities) is built on one thread of its own, so
/health and every other request's tokens keep their turns on the loop (the thread hands the GIL back
every `sys.getswitchinterval()`); a light one is built in place, cheaper than the hop. One thread:
heavy responses wait for each other, not the loop.

A serialising call holds the GIL from start to end (17 MB of n = 16 choices' log probabilities: one
153 ms call here), so a response is serialised in pieces (`dump`): a choice at a time, its log
probabilities already JSON text (orca_mq.api.logprobs), spliced in; the loop gets the GIL between them.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pydantic import BaseModel

T = TypeVar("T")
HEAVY = 2000            # weight past which a response is built off the loop (~a few ms of building)
CHARS_PER_WEIGHT = 64   # characters of text that weigh as much as one log probability
_NULL = '"logprobs":null'


def weight(entries: int, chars: int) -> int:
    return entries + chars // CHARS_PER_WEIGHT


def dump(resp: BaseModel) -> str:
    """A response's JSON (its choices' `logprobs` are JSON text: orca_mq.api.logprobs), in pieces."""
    choices = getattr(resp, "choices", None)
    if not choices:
        return resp.model_dump_json(warnings=False)
    parts = []
    for c in choices:
        lp, c.logprobs = c.logprobs, None
        text = c.model_dump_json(warnings=False)
        parts.append(text if lp is None else text.replace(_NULL, '"logprobs":' + lp, 1))   # message text is escaped
        c.logprobs = lp
    resp.choices = []
    try:
        return resp.model_dump_json(warnings=False).replace('"choices":[]', '"choices":[' + ",".join(parts) + "]", 1)
    finally:
        resp.choices = choices


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
