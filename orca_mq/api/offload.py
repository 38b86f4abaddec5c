"""Responses built off the HTTP event loop when they are heavy.

A response's weight is the log probabilities it carries plus its text (what building and
serialising it costs, and what parsing a reply for tool calls costs). A heavy one (an n = 16 answer
with top_logprobs, a prompt echoed with its log probabilities) is built on one thread of its own, so
/health and every other request's tokens keep their turns on the loop (the thread hands the GIL back
every `sys.getswitchinterval()`); a light one is built in place, cheaper than the hop. One thread:
heavy responses wait for each other, not the loop.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
HEAVY = 2000            # weight past which a response is built off the loop (~a few ms of building)
CHARS_PER_WEIGHT = 64   # characters of text that weigh as much as one log probability


def weight(entries: int, chars: int) -> int:
    return entries + chars // CHARS_PER_WEIGHT


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
