"""One HTTP request's generation: the broker's token stream with stop strings applied, usage,
outcome, and the per-request latency metrics.

A stop string ends the request early: the text is cut before it and the server is told to abort,
and the stream is read to its final event so that the prompt's token count (usage) is known.
Leaving the iterator early (the HTTP client disconnected) closes the broker stream, which
sends `abort`: the scheduler frees the request's KV at its next iteration.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from orca_mq.protocol.common_msgs import ABORTED
from orca_mq.client import AsyncClient, StreamEvent
from orca_mq.protocol.logprobs import Logprobs
from orca_mq.api.errors import ApiError, classify
from orca_mq.api.metrics import ApiMetrics

T = TypeVar("T")


OUTCOME_BY_STATUS = {400: "invalid", 401: "unauthorized", 429: "overloaded", 500: "internal_error", 503: "unavailable"}


def partial_tail(text: str, marks: list[str]) -> int:
    """The length of the longest end of `text` that begins one of `marks` (0: none): what a stream
    holds back until the next piece says whether a mark follows."""
    return next((k for k in range(min(len(text), max(map(len, marks), default=1) - 1), 0, -1)
                 if any(m.startswith(text[-k:]) for m in marks)), 0)


@dataclass(slots=True)
class StopStrings:
    """Holds back text that may be the start of a stop string until it is known not to be."""

    stops: list[str]
    held: str = ""
    hit: str | None = None    # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self.held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.held = ""
            at, self.hit = min(hits)
            return buf[:at], True
        keep = partial_tail(buf, self.stops)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


@dataclass(slots=True)
class Generation:
    client: AsyncClient
    prompt_args: dict[str, Any]
    sampling: dict[str, Any]
    stops: StopStrings
    metrics: ApiMetrics
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    on_behalf_of: str = ""                    # the end client it counts for (orca_mq.api.edge.end_client)
    arrival: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    cached_tokens: int = 0            # of those, taken from the prefix cache (the scheduler's count)
    completion_tokens: int = 0
    finish_reason: str | None = None
    first_token: float | None = None          # time.monotonic() of its first token and its last
    last_token: float | None = None
    stream: bool = True                       # False: the server holds its tokens for a few events (orca_mq.server.held_rows)
    echo_only: bool = False                   # completions' echo with max_tokens 0: the one generated token is dropped
    logprobs: Logprobs | None = None          # the generated tokens' (up to a stop string's), when asked
    prompt_logprobs: Logprobs | None = None   # the prompt's, when asked (echo)
    fresh: Logprobs | None = None             # generated tokens' not yet taken into a chunk (`take`)
    prompt_tail: str | None = None            # a chat prompt's end, from its first event (orca_mq.api.reply)

    async def pieces(self) -> AsyncIterator[str]:
        """Text deltas (possibly empty, one per server event); raises ApiError if the server refuses."""
        stream = self.client.stream(request_id=self.request_id, on_behalf_of=self.on_behalf_of, stream=self.stream,
                                    **self.prompt_args, **self.sampling)
        stopped = False
        try:
            async for ev in stream:
                text = ""
                ev = self._logprobs_of(ev)
                if not stopped:
                    self._tokens(len(ev.token_ids))
                    self._keep(ev.logprobs)
                    text, stopped = self.stops.feed(ev.text)
                    if stopped:  # keep reading: the final event brings the prompt's token count
                        await self.client.abort(self.request_id)
                    elif ev.finished:
                        text += self.stops.flush()
                if ev.finished:
                    self._finish(ev, stopped)  # raises if refused or failed
                    yield text
                    return
                if text or not stopped:
                    yield text
        finally:
            await stream.aclose()
            if self.finish_reason is None:
                self.metrics.outcome("abort")  # the HTTP client left

    def _logprobs_of(self, ev: StreamEvent) -> StreamEvent:
        """Keeps the prompt's log probabilities (and end); an echo-only request's event without its token."""
        if ev.prompt_tail is not None:
            self.prompt_tail = ev.prompt_tail
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if self.echo_only and (ev.token_ids or ev.text or ev.logprobs is not None):
            ev = dataclasses.replace(ev, token_ids=[], text="", logprobs=None)
        return ev

    def _keep(self, lp: Logprobs | None) -> None:
        if lp is None:
            return
        for kept in ("logprobs", "fresh"):
            if getattr(self, kept) is None:
                setattr(self, kept, Logprobs())
            getattr(self, kept).extend(lp)

    def take(self) -> Logprobs | None:
        """The generated tokens' log probabilities since the last take (a streamed chunk's)."""
        fresh, self.fresh = self.fresh, None
        return fresh

    def _tokens(self, n: int) -> None:
        self.completion_tokens += n
        if n and self.stream:   # held: its times come with its final
            now = time.monotonic()
            self._timed(now, now)

    def _timed(self, first: float, last: float) -> None:
        """Tokens that arrived from `first` to `last`: TTFT with the first ever, the gap since the last ones."""
        if self.first_token is None:
            self.first_token = first
            self.metrics.ttft.observe(first - self.arrival)
        else:
            self.metrics.itl.observe(first - self.last_token)   # type: ignore[operator]
        self.last_token = last

    def _finish(self, ev: StreamEvent, stopped: bool) -> None:
        reason, metrics = ev.finish_reason, ev.metrics or {}
        first, end = metrics.get("first_token_time"), metrics.get("finish_time")
        if not self.stream and self.completion_tokens and isinstance(first, float) and isinstance(end, float):
            now = time.monotonic()   # the frontend's times on this clock, the final's arrival their anchor
            self._timed(now - (end - first), now)
        self.prompt_tokens = int(metrics.get("prompt_tokens", 0))
        self.cached_tokens = int((metrics.get("scheduler") or {}).get("cached_tokens", 0))
        if stopped or reason in ("stop", "length"):
            self.finish_reason = "stop" if stopped else reason
            self.metrics.finished(self, time.monotonic())
            return
        err = classify(ev.code or (ABORTED if reason == "abort" else None), ev.error or f"request {reason} by the server",
                       ev.param)
        self.finish_reason = "error"
        self.metrics.outcome(OUTCOME_BY_STATUS.get(err.status, "error"))
        raise err


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the HTTP client disconnects first, cancel it (which aborts the request)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled: never leave the request running
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ApiError(499, "client disconnected", "aborted")
    return task.result()
