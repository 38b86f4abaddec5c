"""Replay a trace against a running system: each request is sent at its arrival time.

All client-API usage is in :func:`open_client` and :func:`stream_request`; adapt those two if the
client changes. The replayer needs from the client only: ``AsyncClient(address)`` as an async
context manager, concurrent ``client.stream(...)`` calls on one client (one per in-flight
request), and events with ``request_id``, ``token_ids``, ``finished``, ``finish_reason``,
``error`` and ``metrics`` attributes.

Times are ``time.perf_counter()`` seconds relative to the start of the replay (t = 0 is when the
first request is due).
"""
from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from orca_mq.bench.trace import TraceRequest

# ---------------------------------------------------------------- the client, in one place

def open_client(address: str) -> Any:
    from orca_mq.client import AsyncClient

    return AsyncClient(address)


async def stream_request(client: Any, prompt_token_ids: list[int], max_tokens: int) -> AsyncIterator[Any]:
    """Stream one request: greedy, generation forced to max_tokens (ignore_eos)."""
    async for ev in client.stream(prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
                                  temperature=0.0, ignore_eos=True):
        yield ev


# ---------------------------------------------------------------- one request

def new_record(req: TraceRequest) -> dict[str, Any]:
    return {
        "index": req.index,
        "request_id": None,
        "scheduled_s": req.arrival_s,
        "arrival_s": None,
        "first_token_s": None,
        "finish_s": None,
        "prompt_tokens": req.input_len,
        "max_tokens": req.max_tokens,
        "generated_tokens": 0,
        "finish_reason": None,
        "error": None,
        "metrics": None,
        "token_times_s": [],
    }


async def run_request(client: Any, req: TraceRequest, clock: Callable[[], float],
                      timeout: float | None = None) -> dict[str, Any]:
    """Send one request now and record what comes back; never raises (errors go in the record)."""
    rec = new_record(req)
    rec["arrival_s"] = clock()
    finished = False
    try:
        async with asyncio.timeout(timeout):
            async for ev in stream_request(client, req.prompt_token_ids, req.max_tokens):
                t = clock()
                if rec["request_id"] is None and getattr(ev, "request_id", None) is not None:
                    rec["request_id"] = str(ev.request_id)
                ids = list(getattr(ev, "token_ids", None) or [])
                if ids:
                    if rec["first_token_s"] is None:
                        rec["first_token_s"] = t
                    rec["token_times_s"].extend([t] * len(ids))
                    rec["generated_tokens"] += len(ids)
                err = getattr(ev, "error", None)
                if err and rec["error"] is None:
                    rec["error"] = str(err)
                if getattr(ev, "finished", False):
                    finished = True
                    rec["finish_s"] = t
                    rec["finish_reason"] = getattr(ev, "finish_reason", None)
                    rec["metrics"] = getattr(ev, "metrics", None)
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

async def replay(address: str, trace: Sequence[TraceRequest], *, progress: bool = True,
                 request_timeout: float | None = None, warmup: int = 0,
                 client_factory: Callable[[str], Any] = open_client) -> tuple[list[dict[str, Any]], float]:
    """Send every request at its arrival time; return (records in trace order, wall-clock start)."""
    from tqdm import tqdm

    async with client_factory(address) as client:
        for i in range(warmup):
            w = TraceRequest(index=-1 - i, arrival_s=0.0,
                             prompt_token_ids=list(trace[i % len(trace)].prompt_token_ids[:16]), max_tokens=4)
            rec = await run_request(client, w, time.perf_counter, timeout=request_timeout)
            if rec["error"] is not None:
                raise RuntimeError(f"warm-up request failed: {rec['error']}")

        order = sorted(trace, key=lambda r: (r.arrival_s, r.index))
        bar = tqdm(total=len(order), unit="req", file=sys.stderr, dynamic_ncols=True, disable=not progress)
        state = {"sent": 0, "done": 0, "tokens": 0, "errors": 0}

        t0 = time.perf_counter()
        wall_start = time.time()

        def clock() -> float:
            return time.perf_counter() - t0

        async def one(req: TraceRequest) -> dict[str, Any]:
            state["sent"] += 1
            rec = await run_request(client, req, clock, timeout=request_timeout)
            state["done"] += 1
            state["tokens"] += rec["generated_tokens"]
            state["errors"] += rec["error"] is not None
            bar.set_postfix(inflight=state["sent"] - state["done"], tok=state["tokens"],
                            err=state["errors"], refresh=False)
            bar.update(1)
            return rec

        tasks = []
        try:
            for req in order:
                delay = req.arrival_s - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req)))
            records = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            bar.close()
    records.sort(key=lambda r: r["index"])
    return records, wall_start
