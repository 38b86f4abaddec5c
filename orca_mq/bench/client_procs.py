"""A replay spread over several client processes.

At tens of thousands of tokens per second one Python client spends about as much CPU per token as a
server process (~60 us: a frame to decode, an event to queue and wake per token), so a benchmark
with one client measures the client. Here each of N processes replays its share of the trace with
its own client (request i goes to process i mod N; a conversation stays in one process), after its
own warm-up; all start at one instant (time.perf_counter is the system-wide monotonic clock on
Linux, so one t = 0 serves every process) and their records merge in trace order.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable, Coroutine, Sequence
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from orca_mq.bench.replay import open_client, replay
from orca_mq.bench.trace import ChatTurn, TraceRequest

T = TypeVar("T")
START_MARGIN_S = 0.2      # t = 0 is this far after the last process is ready: every one is waiting by then


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop (the servers' loop) where it is installed."""
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(coro)


def shares(trace: Sequence[TraceRequest] | Sequence[ChatTurn], n: int) -> list[list[Any]]:
    """The trace cut into n shares: round robin by request, or by conversation for a chat trace."""
    key = (lambda r: r.conversation) if trace and isinstance(trace[0], ChatTurn) else (lambda r: r.index)
    return [[r for r in trace if key(r) % n == i] for i in range(n)]


def replay_in_processes(address: str, trace: Sequence[TraceRequest] | Sequence[ChatTurn], n_procs: int, *,
                        warmup: int = 0, request_timeout: float | None = None,
                        client_factory: Callable[[str], Any] = open_client,
                        on_start: Callable[[], None] = lambda: None) -> tuple[list[dict[str, Any]], float, float]:
    """`replay` in `n_procs` processes (spawned: `client_factory` must pickle) started together, `on_start`
    called once all are warmed up, just before; returns (every record in trace order, the wall-clock start,
    the CPU seconds the processes spent replaying). A process that fails raises RuntimeError here."""
    ctx = multiprocessing.get_context("spawn")
    conns: list[Connection] = []
    procs = []
    try:
        for share in filter(None, shares(trace, n_procs)):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client_process, args=(theirs, address, share, warmup, request_timeout, client_factory),
                               daemon=True)
            proc.start()
            conns.append(mine)
            procs.append(proc)
        for conn in conns:
            _answer(conn)   # warmed up
        on_start()
        t0 = time.perf_counter() + START_MARGIN_S
        for conn in conns:
            conn.send(t0)
        results = [_answer(conn) for conn in conns]
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
    records = sorted((r for recs, _, _ in results for r in recs), key=lambda r: r["index"])
    return records, min(start for _, start, _ in results), sum(cpu for _, _, cpu in results)


def _answer(conn: Connection) -> Any:
    try:
        kind, value = conn.recv()
    except EOFError:
        raise RuntimeError("a client process died") from None
    if kind == "error":
        raise RuntimeError(f"a client process failed: {value}")
    return value


def _client_process(conn: Connection, address: str, trace: list[Any], warmup: int, request_timeout: float | None,
                    client_factory: Callable[[str], Any]) -> None:
    cpu = 0.0

    async def start() -> float:
        nonlocal cpu
        conn.send(("ready", None))
        t0 = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        cpu = time.process_time()
        return t0

    try:
        records, wall_start = run_loop(replay(address, trace, progress=False, request_timeout=request_timeout, warmup=warmup,
                                              client_factory=client_factory, start=start))
        conn.send(("ok", (records, wall_start, time.process_time() - cpu)))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
