"""Replay a trace against a running system.

A token trace (:class:`TraceRequest`) is open loop: each request is sent at its arrival time. A
chat trace (:class:`ChatTurn`) is closed loop per conversation: turn 0 is sent at its time, and
turn k + 1 is sent when turn k's final message has come back (plus the think time), with the
conversation so far as its messages: every earlier message and the answers the server gave.

All client-API usage is in :func:`open_client` and :func:`stream_request`; adapt those two if the
client changes. Requests are greedy unless the client is a :class:`SampledClient`. The replayer needs from the client only: ``AsyncClient(address)`` as an async
context manager, concurrent ``client.stream(...)`` calls on one client (one per in-flight
request) taking ``prompt_token_ids=`` or ``messages=``, and events with ``request_id``,
``token_ids``, ``text``, ``finished``, ``finish_reason``, ``error`` and ``metrics`` attributes.

Times are ``time.perf_counter()`` seconds relative to the start of the replay (t = 0 is when the
first request is due).
"""
from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from orca_mq.bench.trace import ChatTurn, TraceRequest

# ---------------------------------------------------------------- the client, in one place

def open_client(address: str) -> Any:
    from orca_mq.client import AsyncClient

    return AsyncClient(address)


class SampledClient:
    """The ZeroMQ client, every request sampled as `sampling` says (SamplingParams' fields, for instance
    {"temperature": 1.0, "seed": 0, "logprobs": 5}) instead of greedily: the sampler's and the log
    probabilities' share of an iteration in a replay (tools/bench.py --sampling)."""

    def __init__(self, address: str, sampling: dict[str, Any]) -> None:
        self.client = open_client(address)
        self.sampling = sampling

    async def __aenter__(self) -> "SampledClient":
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.__aexit__(*exc)

    def stream(self, **kwargs: Any) -> AsyncIterator[Any]:
        return self.client.stream(**(kwargs | self.sampling))


async def stream_request(client: Any, prompt: dict[str, Any], max_tokens: int) -> AsyncIterator[Any]:
    """Stream one request (``prompt``: prompt_token_ids= or messages=): greedy (unless the client
    samples: SampledClient), generation forced to max_tokens."""
    async for ev in client.stream(**prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        yield ev


def served_counts(metrics: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """(prompt tokens, of them cached) as a final message reports them: an OpenAI server's usage
    (`prompt_tokens_details.cached_tokens`: OpenAI, orca-mq's HTTP API, llama.cpp) or the ZeroMQ
    client's metrics (the scheduler's count); None where the server does not say."""
    m = metrics or {}
    if isinstance(m.get("usage"), dict):
        return m["usage"].get("prompt_tokens"), (m["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    return m.get("prompt_tokens"), (m.get("scheduler") or {}).get("cached_tokens")


# ---------------------------------------------------------------- one request

def new_record(index: int, scheduled_s: float | None, prompt_tokens: int | None, max_tokens: int,
               **extra: Any) -> dict[str, Any]:
    return {
        "index": index,
        "request_id": None,
        "scheduled_s": scheduled_s,
        "arrival_s": None,
        "first_token_s": None,
        "finish_s": None,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": None,
        "max_tokens": max_tokens,
        "generated_tokens": 0,
        "finish_reason": None,
        "error": None,
        "metrics": None,
        "token_times_s": [],
        **extra,
    }


async def run_request(client: Any, rec: dict[str, Any], prompt: dict[str, Any], clock: Callable[[], float],
                      timeout: float | None = None, text: list[str] | None = None) -> dict[str, Any]:
    """Send one request now and fill its record (and ``text`` with the answer's pieces, if given);
    never raises (errors go in the record)."""
    rec["arrival_s"] = clock()
    finished = False
    try:
        async with asyncio.timeout(timeout):
            async for ev in stream_request(client, prompt, rec["max_tokens"]):
                t = clock()
                if rec["request_id"] is None and getattr(ev, "request_id", None) is not None:
                    rec["request_id"] = str(ev.request_id)
                ids = list(getattr(ev, "token_ids", None) or [])
                if ids:
                    if rec["first_token_s"] is None:
                        rec["first_token_s"] = t
                    rec["token_times_s"].extend([t] * len(ids))
                    rec["generated_tokens"] += len(ids)
                if text is not None:
                    text.append(getattr(ev, "text", "") or "")
                err = getattr(ev, "error", None)
                if err and rec["error"] is None:
                    rec["error"] = str(err)
                if getattr(ev, "finished", False):
                    finished = True
                    rec["finish_s"] = t
                    rec["finish_reason"] = getattr(ev, "finish_reason", None)
                    rec["metrics"] = getattr(ev, "metrics", None)
                    n_prompt, rec["cached_tokens"] = served_counts(rec["metrics"])
                    rec["prompt_tokens"] = rec["prompt_tokens"] if n_prompt is None else n_prompt
                    break
        if not finished and rec["error"] is None:
            rec["error"] = "stream ended without a finished event"
    except TimeoutError:
        rec["error"] = f"timeout: no finished event within {timeout} s"
    except Exception as e:  # noqa: BLE001 - any client failure is this request's error
        rec["error"] = f"{type(e).__name__}: {e}"
    if rec["finish_s"] is None:
        rec["finish_s"] = clock()
    if rec["finish_reason"] in ("error", "abort") and rec["error"] is None:
        rec["error"] = f"finish_reason={rec['finish_reason']}"
    return rec


# ---------------------------------------------------------------- the whole trace

Send = Callable[[dict[str, Any], dict[str, Any], "list[str] | None"], Awaitable[dict[str, Any]]]


def warmup_prompt(req: TraceRequest | ChatTurn) -> dict[str, Any]:
    """A short prompt from a request of the trace, one no request of it starts with (so it caches nothing they use)."""
    if isinstance(req, ChatTurn):
        return {"messages": [{"role": "user", "content": req.messages[-1]["content"][-64:]}]}
    return {"prompt_token_ids": list(req.prompt_token_ids[-16:])}


async def open_loop(trace: Sequence[TraceRequest], send: Send, clock: Callable[[], float]) -> list[dict[str, Any]]:
    """Every request at its arrival time, whatever the others are doing."""
    tasks = []
    try:
        for req in sorted(trace, key=lambda r: (r.arrival_s, r.index)):
            delay = req.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = new_record(req.index, req.arrival_s, req.input_len, req.max_tokens)
            tasks.append(asyncio.create_task(send(rec, {"prompt_token_ids": req.prompt_token_ids}, None)))
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def closed_loop(trace: Sequence[ChatTurn], send: Send, clock: Callable[[], float]) -> list[dict[str, Any]]:
    """Each conversation's turns one after another, each with the conversation so far as its messages."""
    async def talk(turns: list[ChatTurn]) -> list[dict[str, Any]]:
        history: list[dict[str, str]] = []
        recs: list[dict[str, Any]] = []
        for k, turn in enumerate(turns):
            due = recs[-1]["finish_s"] + turn.delay_s if k else turn.delay_s
            rec = new_record(turn.index, due, None, turn.max_tokens, conversation=turn.conversation, turn=turn.turn)
            await asyncio.sleep(max(0.0, due - clock()))
            history += turn.messages
            answer: list[str] = []
            recs.append(await send(rec, {"messages": list(history)}, answer))
            if rec["error"] is not None:   # no answer, no next turn: the rest are recorded as not sent
                recs += [new_record(t.index, None, None, t.max_tokens, conversation=t.conversation, turn=t.turn,
                                    error=f"not sent: turn {turn.turn} failed") for t in turns[k + 1:]]
                break
            history.append({"role": "assistant", "content": "".join(answer)})
        return recs

    by_conversation: dict[int, list[ChatTurn]] = {}
    for t in sorted(trace, key=lambda t: (t.conversation, t.turn)):
        by_conversation.setdefault(t.conversation, []).append(t)
    tasks = [asyncio.create_task(talk(turns)) for turns in by_conversation.values()]
    try:
        return [rec for recs in await asyncio.gather(*tasks) for rec in recs]
    finally:
        for t in tasks:
            t.cancel()


async def replay(address: str, trace: Sequence[TraceRequest] | Sequence[ChatTurn], *, progress: bool = True,
                 request_timeout: float | None = None, warmup: int = 0,
                 client_factory: Callable[[str], Any] = open_client,
                 start: Callable[[], Awaitable[float]] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Send a token trace open loop or a chat trace closed loop; return (records in trace order, wall-clock start).
    `start`, awaited after the warm-up, gives t = 0 as a time.perf_counter() value (one instant for
    several client processes: orca_mq.bench.client_procs); default: at once."""
    from tqdm import tqdm

    async with client_factory(address) as client:
        for i in range(warmup):
            req = trace[i % len(trace)]
            rec = await run_request(client, new_record(-1 - i, 0.0, None, 4), warmup_prompt(req), time.perf_counter,
                                    timeout=request_timeout)
            if rec["error"] is not None:
                raise RuntimeError(f"warm-up request failed: {rec['error']}")

        bar = tqdm(total=len(trace), unit="req", file=sys.stderr, dynamic_ncols=True, disable=not progress)
        state = {"sent": 0, "done": 0, "tokens": 0, "errors": 0}

        t0 = await start() if start is not None else time.perf_counter()
        wall_start = time.time() + (t0 - time.perf_counter())

        def clock() -> float:
            return time.perf_counter() - t0

        async def send(rec: dict[str, Any], prompt: dict[str, Any], text: list[str] | None) -> dict[str, Any]:
            state["sent"] += 1
            await run_request(client, rec, prompt, clock, timeout=request_timeout, text=text)
            state["done"] += 1
            state["tokens"] += rec["generated_tokens"]
            state["errors"] += rec["error"] is not None
            bar.set_postfix(inflight=state["sent"] - state["done"], tok=state["tokens"],
                            err=state["errors"], refresh=False)
            bar.update(1)
            return rec

        chat = bool(trace) and isinstance(trace[0], ChatTurn)
        try:
            records = await (closed_loop(trace, send, clock) if chat else open_loop(trace, send, clock))  # type: ignore[arg-type]
        finally:
            bar.close()
    records.sort(key=lambda r: r["index"])
    return records, wall_start
