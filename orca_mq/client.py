"""Python clients: `AsyncClient` (asyncio) and `Client` (sync, the same client on a private loop).

    async with AsyncClient("tcp://127.0.0.1:5555") as client:
        async for ev in client.stream(prompt="Hello", max_tokens=8, temperature=0.0):
            print(ev.text, end="")

Sampling keyword arguments are SamplingParams fields, checked here first (the server checks them
again with the vocabulary): a bad one ends the stream with an `invalid_request` event, nothing is
sent. Leaving a stream early (break, exception, cancellation) aborts the request.
`api_key=` is sent with every request and stats query (servers with `server.api_key`);
`server_key=` (the server's CurveZMQ public key, or its key file) encrypts the connection.
`embed(prompt)` (or `prompt_token_ids=`) returns the prompt's embedding (EmbeddingOutput; `pooling=`
"last" | "mean", the server's model.pooling by default; `normalize=` True: L2-normalised). If the server stops answering — even its broker's pings — for `liveness_timeout`
seconds, every open stream ends with an `error` event; if no server ever answered there (a wrong
port, the HTTP port, a CurveZMQ handshake that fails: no server_key or another one), after
`connect_timeout` seconds, saying so; no send waits longer either (a failed handshake leaves the socket
no peer to take a frame), and the reader never waits on one. The address may be `host:port`
(`tcp://` is added); an http:// URL is a ValueError. Ctrl-C in the blocking `Client` aborts the
request it waits on and raises KeyboardInterrupt to the caller.

An event that ends with "error" (or "abort") carries `code`, one of orca_mq.protocol.common_msgs'
stable codes (invalid_request, overloaded, unavailable, internal, protocol, aborted, unauthorized):
branch on it, show `error` to people.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from orca_mq.auth import curve_client
from orca_mq.outputs import EmbeddingOutput, RequestOutput
from orca_mq.protocol import ProtocolError, decode, encode
from orca_mq.protocol.client_msgs import TO_CLIENT, Abort, Generate, Output, Outputs, Ping, Pong, Stats, StatsReply, events
from orca_mq.protocol.common_msgs import ABORTED, INVALID_REQUEST, UNAUTHORIZED, UNAVAILABLE, Error
from orca_mq.errors import InvalidRequest
from orca_mq.protocol.logprobs import Logprobs
from orca_mq.protocol.pooling import PoolingParams
from orca_mq.protocol.sampling import SamplingParams

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
SCHEMES = ("tcp://", "ipc://", "inproc://")
T = TypeVar("T")


def client_address(address: str) -> str:
    """The ZeroMQ address to connect to: `host:port` gains `tcp://`; an http(s):// URL (the HTTP API's,
    for OpenAI clients) or another scheme is a ValueError that says what to give instead."""
    if address.startswith(SCHEMES):
        return address
    if address.startswith(("http://", "https://")):
        raise ValueError(f"{address} is an HTTP URL (the OpenAI-compatible API's, for OpenAI clients); this client "
                         "speaks ZeroMQ: give tcp://HOST:PORT with the server's --port (orca-mq client --port N)")
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not host or not port.isdigit():
        raise ValueError(f"server address {address!r}: expected tcp://HOST:PORT (or HOST:PORT)")
    return f"tcp://{address}"


@dataclass(slots=True)
class StreamEvent:
    request_id: str
    token_ids: list[int]                  # new tokens in this event (may be empty on the final one)
    text: str                             # new text in this event
    finished: bool = False
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error" on the final event
    error: str | None = None
    metrics: dict[str, Any] | None = None  # final event: server-side timings and token counts
    code: str | None = None               # final "error" / "abort" event: a stable common_msgs code
    logprobs: Logprobs | None = None      # token_ids' log probabilities (sampling `logprobs=k`)
    prompt_logprobs: Logprobs | None = None  # with the first tokens: the prompt's (`prompt_logprobs=k`)
    param: str | None = None              # a refused request's field at fault, where one is (prompt, max_tokens, ...)
    prompt_tail: str | None = None        # with a chat request's first tokens: its rendered prompt's end
    embedding: bytes | None = None        # an embedding request's final event: its vector (float32, little-endian)


def _final_error(request_id: str, error: str, code: str, param: str | None = None) -> StreamEvent:
    return StreamEvent(request_id, [], "", True, "error", error, code=code, param=param)


def _checked(out: Output) -> tuple[Logprobs | None, Logprobs | None]:
    """An output's log probabilities, dropped when their columns disagree (a frame from the wire)."""
    return tuple(lp if lp is not None and lp.consistent() else None  # type: ignore[return-value]
                 for lp in (out.logprobs, out.prompt_logprobs))


class AsyncClient:
    def __init__(self, address: str = DEFAULT_ADDRESS, *, api_key: str | None = None, server_key: str | None = None,
                 liveness_timeout: float = 15.0, ping_interval: float = 2.0, connect_timeout: float = 5.0) -> None:
        self.address = client_address(address)
        self.connect_timeout = connect_timeout   # no reply ever from this address within it: no server there
        self.api_key = api_key or ""
        self.server_key = server_key
        self.liveness_timeout = liveness_timeout
        self.ping_interval = ping_interval
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._streams: dict[str, asyncio.Queue[StreamEvent]] = {}
        self._stats: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._last_heard = 0.0
        self._server = ""     # the broker instance first heard from; another one means it restarted

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, int(self.connect_timeout * 1000))   # no peer to take a frame (a failed
        # CurveZMQ handshake leaves none) or a full queue: a send gives up, the request fails saying why
        if self.server_key:
            curve_client(self._sock, self.server_key)
        self._sock.connect(self.address)
        self._last_heard = time.monotonic()
        self._reader = asyncio.create_task(self._read())
        self._post(Ping(0))  # learn the broker's identity before any request

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._fail_all("client closed", ABORTED)
        if self._sock is not None:
            self._sock.close(linger=0)
            assert self._ctx is not None
            self._ctx.term()
        self._sock = self._ctx = self._reader = None

    def stream(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
               messages: list[dict[str, Any]] | None = None, chat: bool = False,
               chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
               request_id: str | None = None, on_behalf_of: str = "", stream: bool = True,
               **sampling: Any) -> AsyncIterator[StreamEvent]:
        """Submit a request and yield its events as tokens are produced; the last has finished=True
        (`stream` False: the server sends the first at once and holds the rest for a few events,
        orca_mq.server.held_rows).
        `chat_template_kwargs`: more variables for the chat template (with messages or chat=True); `tools`:
        OpenAI's function tools, which the chat template renders (messages may then hold tool_calls).
        `on_behalf_of`: a gateway's end client the request is for: a client of its own in the server's
        fair shares of the queue and the KV pool."""
        def frame(rid: str) -> bytes:
            params = SamplingParams.from_dict(sampling)
            params.validate()
            given = sampling
            if isinstance(sampling.get("logit_bias"), dict):   # {token_id: bias}: map keys travel as strings
                given = {**sampling, "logit_bias": params.logit_bias}
            return encode(Generate(rid, prompt, prompt_token_ids, messages, chat, given, self.api_key, chat_template_kwargs,
                                   on_behalf_of, tools, stream=stream))

        return self._submit(request_id or uuid.uuid4().hex, frame)

    async def embed(self, prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
                    pooling: str | None = None, normalize: bool = True, request_id: str | None = None,
                    on_behalf_of: str = "") -> EmbeddingOutput:
        """The prompt's embedding (a prompt in, a vector out: nothing is generated); `on_behalf_of` as stream's."""
        def frame(rid: str) -> bytes:
            params = PoolingParams(pooling, normalize)
            params.validate()
            return encode(Generate(rid, prompt, prompt_token_ids, api_key=self.api_key, on_behalf_of=on_behalf_of,
                                   pooling=params.to_dict()))

        events = self._submit(request_id or uuid.uuid4().hex, frame)
        try:
            async for ev in events:
                if ev.finished:
                    return EmbeddingOutput(ev.request_id, ev.embedding or b"", int((ev.metrics or {}).get("prompt_tokens", 0)),
                                           ev.finish_reason, ev.error, ev.code, ev.param, ev.metrics)
        finally:
            await events.aclose()
        raise RuntimeError("stream ended without a final event")

    async def _submit(self, rid: str, frame: Callable[[str], bytes]) -> AsyncIterator[StreamEvent]:
        """Send the frame `frame(rid)` builds (a refusal here ends the stream at once, nothing sent) and
        yield its request's events; leaving early aborts the request."""
        try:
            data = frame(rid)
        except InvalidRequest as e:
            yield _final_error(rid, str(e), INVALID_REQUEST, e.param)
            return
        except (OverflowError, TypeError, ValueError) as e:  # msgpack: an integer over 64 bits, an object it cannot pack
            yield _final_error(rid, f"invalid request: cannot be sent ({e})", INVALID_REQUEST)
            return
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._streams[rid] = queue
        try:
            if not await self._send_raw(data):
                self._streams.pop(rid, None)
                yield _final_error(rid, self._no_server(self.connect_timeout), UNAVAILABLE)
                return
            while True:
                ev = await queue.get()
                yield ev
                if ev.finished:
                    return
        finally:
            if self._streams.pop(rid, None) is not None and self._sock is not None:
                self._post(Abort(rid))  # left early: free the request's KV

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> RequestOutput:
        """Run a request to the end and return everything it produced (the server holds its tokens for a
        few events: `stream=True` to have them token by token all the same)."""
        kwargs.setdefault("stream", False)
        text: list[str] = []
        ids: list[int] = []
        logprobs: Logprobs | None = None
        prompt_logprobs: Logprobs | None = None
        async for ev in self.stream(prompt, **kwargs):
            text.append(ev.text)
            ids.extend(ev.token_ids)
            if ev.logprobs is not None:
                logprobs = ev.logprobs if logprobs is None else (logprobs.extend(ev.logprobs) or logprobs)
            prompt_logprobs = ev.prompt_logprobs or prompt_logprobs
            if ev.finished:
                return RequestOutput(ev.request_id, "".join(text), ids, ev.finish_reason, ev.error, ev.metrics, ev.code,
                                     logprobs=logprobs, prompt_logprobs=prompt_logprobs, param=ev.param)
        raise RuntimeError("stream ended without a final event")

    async def abort(self, request_id: str) -> None:
        """Ask the server to abort; the stream then ends with finish_reason "abort"."""
        await self._send(Abort(request_id))

    async def stats(self, *, record: bool = False, reset: bool = False, timeout: float = 10.0) -> dict[str, Any]:
        """Scheduler (free/used KV slots, ...), worker and frontend counters."""
        qid = uuid.uuid4().hex
        fut = self._stats[qid] = asyncio.get_running_loop().create_future()
        try:
            if not await self._send(Stats(qid, record, reset, self.api_key)) and not fut.done():
                fut.set_exception(ConnectionError(self._no_server(self.connect_timeout)))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats.pop(qid, None)

    async def _send(self, msg: Any) -> bool:
        return await self._send_raw(encode(msg))

    async def _send_raw(self, frame: bytes) -> bool:
        """False when the frame could not be handed to a peer within connect_timeout (SNDTIMEO)."""
        if self._sock is None:
            raise RuntimeError("client is not connected (use `async with` or connect())")
        try:
            await self._sock.send(frame)
        except zmq.Again:
            return False
        return True

    def _post(self, msg: Any) -> None:
        """Send without waiting (the reader must never wait on a send): a ping or a parting abort that
        cannot go now is dropped; liveness covers the rest."""
        if self._sock is not None:
            self._sock.send(encode(msg), zmq.NOBLOCK).add_done_callback(_retrieved)

    def _no_server(self, silent: float) -> str:
        key = ("is server_key (--server-key) its CurveZMQ public key" if self.server_key else
               "does it use CurveZMQ (then give its public key: server_key=, --server-key on the command line)")
        return (f"no orca-mq server answers at {self.address} after {silent:.0f} s: is it running, is this its client "
                f"port (--port, not --http-port), and {key}?")

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            interval = self.ping_interval if self._server else min(self.ping_interval, 0.5)  # until the first pong
            try:   # a poll may wake without a frame (a CurveZMQ handshake that fails): recv never waits
                frame = await self._sock.recv(zmq.NOBLOCK) if await self._sock.poll(int(interval * 1000)) else None
            except zmq.Again:
                frame = None
            if frame is None:
                self._check_liveness()
                continue
            self._last_heard = time.monotonic()
            try:
                msg = decode(frame, TO_CLIENT)
            except ProtocolError:
                continue  # not for us to act on; the server never sends these
            if isinstance(msg, (Output, Outputs)):  # `outputs`: one iteration, a row per request of ours it moved
                for out in events(msg):
                    self._deliver(out.request_id, StreamEvent(out.request_id, out.token_ids, out.text, out.finished,
                                                              out.finish_reason, out.error, out.metrics, out.code,
                                                              *_checked(out), param=out.param,
                                                              prompt_tail=out.prompt_tail, embedding=out.embedding))
            elif isinstance(msg, Error) and msg.request_id is not None:
                self._deliver(msg.request_id, _final_error(msg.request_id, msg.error, msg.code))
            elif isinstance(msg, StatsReply):
                fut = self._stats.get(msg.query_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg.stats)
            elif isinstance(msg, Error):
                failure = PermissionError if msg.code == UNAUTHORIZED else RuntimeError
                for fut in self._stats.values():  # a rejected stats query is the only request without an id
                    if not fut.done():
                        fut.set_exception(failure(msg.error))
            elif isinstance(msg, Pong) and msg.server:
                if self._server and msg.server != self._server:
                    self._fail_all("server unavailable: it restarted and lost the request, retry it", UNAVAILABLE)
                self._server = msg.server

    def _check_liveness(self) -> None:
        if not self._streams and not self._stats:
            self._last_heard = time.monotonic()
            return
        silent = time.monotonic() - self._last_heard
        if not self._server and silent >= self.connect_timeout:  # never a pong: nothing of ours listens there
            self._fail_all(self._no_server(silent), UNAVAILABLE)
            self._last_heard = time.monotonic()
        elif silent >= self.liveness_timeout:
            self._fail_all(f"server unreachable: no reply for {silent:.0f} s", UNAVAILABLE)
            self._last_heard = time.monotonic()
        else:
            self._post(Ping(int(time.monotonic() * 1000)))

    def _deliver(self, request_id: str, ev: StreamEvent) -> None:
        queue = self._streams.get(request_id)
        if queue is None:
            return  # a stream we already left
        if ev.finished:
            del self._streams[request_id]  # settled: nothing to abort when the generator closes
        queue.put_nowait(ev)

    def _fail_all(self, error: str, code: str) -> None:
        for rid in list(self._streams):
            self._deliver(rid, _final_error(rid, error, code))
        for fut in self._stats.values():
            if not fut.done():
                fut.set_exception(ConnectionError(error))


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """A posted frame's outcome, read so that asyncio does not report a dropped one."""
    if not fut.cancelled():
        fut.exception()


async def _cancel(running: list[asyncio.Task[Any]]) -> None:
    """Cancel the task `running` holds (it started before this one: the loop runs callbacks in order) and wait for it."""
    for task in running:
        task.cancel()
        await asyncio.wait([task])


class Client:
    """Blocking client: the AsyncClient on an event loop in a private thread. Ctrl-C during a call
    (or while a stream waits for tokens) cancels it on that loop (aborting its request) and raises
    KeyboardInterrupt to the caller, as any blocking call does."""

    def __init__(self, address: str = DEFAULT_ADDRESS, **kwargs: Any) -> None:
        self._client = AsyncClient(address, **kwargs)   # a bad address raises before any thread starts
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="orca-mq-client", daemon=True)
        self._thread.start()
        self._call(self._client.connect())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the client's loop and wait for it. Interrupted while waiting (Ctrl-C: the
        KeyboardInterrupt lands here, in the caller's thread), the coroutine is cancelled there and
        waited for (a stream it was reading aborts its request), then the interrupt goes on to the caller."""
        running: list[asyncio.Task[Any]] = []

        async def run() -> T:
            running.append(asyncio.current_task())  # type: ignore[arg-type]
            return await coro

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return fut.result()
        except BaseException:
            if not fut.done():
                asyncio.run_coroutine_threadsafe(_cancel(running), self._loop).result()
            raise

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[StreamEvent]:
        agen = self._client.stream(prompt, **kwargs)

        async def step() -> StreamEvent | None:
            try:
                return await agen.__anext__()
            except StopAsyncIteration:
                return None

        try:
            while (ev := self._call(step())) is not None:
                yield ev
        finally:  # also after Ctrl-C: _call has stopped the step, so the stream can close (and abort)
            self._call(agen.aclose())

    def generate(self, prompt: str | None = None, **kwargs: Any) -> RequestOutput:
        return self._call(self._client.generate(prompt, **kwargs))

    def embed(self, prompt: str | None = None, **kwargs: Any) -> EmbeddingOutput:
        return self._call(self._client.embed(prompt, **kwargs))

    def abort(self, request_id: str) -> None:
        self._call(self._client.abort(request_id))

    def stats(self, **kwargs: Any) -> dict[str, Any]:
        return self._call(self._client.stats(**kwargs))

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
