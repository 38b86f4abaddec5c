"""Faults against a running server; each has its documented outcome, nothing hangs, and no KV
slot is leaked afterwards.

- malformed / truncated / unknown-type / wrong-version frames: an `error` reply, logged, no crash
- invalid requests (too long, empty, bad sampling values or token ids, unknown fields): an
  `error` final message to that client only
- abort mid-stream: final `abort`; a vanished client: its requests are aborted (ROUTER_MANDATORY)
- SIGKILL of a worker: every in-flight request gets an `error` final, new ones `unavailable` at
  once, and the launcher restarts the engine side, which serves again
- SIGKILL of the broker: everything restarts; an open stream ends with an error
- a crash loop (more than server.max_restarts restarts): the launcher stops and exits 1
- SIGTERM of the launcher: drain, then every process is gone (exit 0) within 30 s
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from orca_mq.client import AsyncClient, Client
from orca_mq.protocol import decode, encode
from orca_mq.protocol.client_msgs import TO_CLIENT, Generate, Output, Ping, events
from orca_mq.protocol.common_msgs import Error
from orca_mq.server.zmq_queue import PEER
from serving_harness import alive, settled, start_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("faults"), n_workers=1, **{"server.drain_timeout": 3.0, "engine.n_slots": 4096})
    yield srv
    srv.stop()


def _dealer(ctx: zmq.Context, address: str, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(address)
    return sock


def _logs(server, role: str) -> str:
    return (server.log_dir / f"{role}.log").read_text()


def test_malformed_frames_are_answered_and_logged(server):
    ctx = zmq.Context()
    try:
        client = _dealer(ctx, server.address)
        bad = [b"\xc1\xc1", encode(Generate("t1", prompt="truncated frame"))[:-3],
               msgpack.packb({"v": 42, "type": "generate", "request_id": "t2", "prompt": "x"}),
               msgpack.packb({"v": 1, "type": "teleport"}),
               msgpack.packb({"v": 1, "type": "generate", "request_id": "t3", "prompt": "x", "colour": "red"})]
        for frame in bad:
            client.send(frame)
            assert client.poll(10_000), f"no reply to {frame!r}"
            assert isinstance(decode(client.recv(), TO_CLIENT), Error)
        # inside the system too: a rogue peer on the backend socket, garbage to the scheduler, the frontend
        # and the first worker's control socket
        run_dir = server.children[server.pid_of("workers.main")].split("--run-dir ")[1].split()[0]
        rogue = _dealer(ctx, f"ipc://{run_dir}/backend", b"rogue")  # the server's private backend socket
        rogue.send_multipart([PEER, b"scheduler", msgpack.packb({"v": 1, "type": "add", "request_id": "x"})])
        assert rogue.poll(10_000) and "missing field" in decode(rogue.recv_multipart()[2], frozenset({"error"})).error
        rogue.send_multipart([PEER, b"frontend", b"\xc1"])
        assert rogue.poll(10_000) and "malformed" in decode(rogue.recv_multipart()[2], frozenset({"error"})).error
        for peer in (b"frontend", b"worker0"):  # well-formed, but not a type that process accepts
            rogue.send_multipart([PEER, peer, encode(Ping(3))])
            assert rogue.poll(10_000) and "not accepted" in decode(rogue.recv_multipart()[2], frozenset({"error"})).error
        control = ctx.socket(zmq.PUSH)
        control.setsockopt(zmq.LINGER, 1000)
        control.connect(f"ipc://{run_dir}/ctl0")
        control.send(msgpack.packb({"v": 1, "type": "plan", "plan": "nonsense", "t_sent": 0.0}))
        control.close()
    finally:
        ctx.destroy(linger=0)
    with Client(server.address) as c:  # still serving
        assert c.generate("Hello", max_tokens=3, temperature=0.0).finish_reason == "length"
    assert "rejected control frame" in _logs(server, "worker0")
    assert "rejected client frame" in _logs(server, "broker")
    settled(server.address)


INVALID = [
    ({"prompt_token_ids": [1] * 2100, "max_tokens": 4}, "context length"),
    ({"prompt": "Hello", "max_tokens": 5000}, "context length"),
    ({"prompt": ""}, "empty prompt"),
    ({"prompt_token_ids": []}, "empty prompt"),
    ({"prompt_token_ids": [1, -5]}, "vocabulary"),
    ({"prompt_token_ids": [1, 10**9]}, "vocabulary"),
    ({"prompt": "x", "temperature": -1.0}, "temperature"),
    ({"prompt": "x", "top_p": 0.0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": "x", "frobnicate": 1}, "unknown field"),
    ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
    ({"prompt_token_ids": [1], "chat": True}, "chat"),
    ({"messages": [{"role": "user"}]}, "messages"),
]


PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages", "chat")


def test_invalid_requests_fail_alone(server):
    """Sent as raw frames: the Python client checks sampling values itself, the server must not rely on it."""
    async def run():
        async with AsyncClient(server.address) as client:
            good = asyncio.create_task(client.generate(prompt="The sky is", max_tokens=6, temperature=0.0, ignore_eos=True))
            ctx = zmq.asyncio.Context()
            raw = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(server.address)
            for i, (kw, _) in enumerate(INVALID):
                await raw.send(encode(Generate(f"bad{i}", **{k: v for k, v in kw.items() if k in PROMPT_FIELDS},
                                               sampling={k: v for k, v in kw.items() if k not in PROMPT_FIELDS})))
            finals: dict[str, Output] = {}
            while len(finals) < len(INVALID):
                assert await raw.poll(60_000)
                msg = decode(await raw.recv(), TO_CLIENT)
                if isinstance(msg, Output) and msg.finished:
                    finals[msg.request_id] = msg
            raw.close()
            ctx.term()
            return await good, [finals[f"bad{i}"] for i in range(len(INVALID))]

    good, bad = asyncio.run(run())
    assert good.finish_reason == "length" and len(good.token_ids) == 6
    for (kw, words), out in zip(INVALID, bad):
        assert out.finish_reason == "error" and out.code == "invalid_request" and out.token_ids == [], kw
        assert words in out.error, (kw, out.error)
    settled(server.address)


def test_abort_mid_stream(server):
    async def run():
        async with AsyncClient(server.address) as client:
            events = []
            async for ev in client.stream(prompt="Count to a thousand:", max_tokens=300, temperature=0.0, ignore_eos=True):
                events.append(ev)
                if len(events) == 2:
                    await client.abort(ev.request_id)
            return events

    events = asyncio.run(run())
    final = events[-1]
    assert final.finished and final.finish_reason == "abort" and final.error is None
    assert 2 <= sum(len(e.token_ids) for e in events) < 300
    settled(server.address)


def test_vanished_client_frees_its_requests(server):
    ctx = zmq.Context()
    try:
        sock = _dealer(ctx, server.address)
        sock.send(encode(Generate("gone", prompt="Tell me everything.", sampling={"max_tokens": 300, "ignore_eos": True})))
        for _ in range(2):
            assert sock.poll(30_000)
            assert all(isinstance(e, Output) for e in events(decode(sock.recv(), TO_CLIENT)))
        sock.close(linger=0)  # the client disappears without a word
    finally:
        ctx.destroy(linger=0)
    stats = settled(server.address)
    assert stats["scheduler"]["free_slots"] == stats["scheduler"]["n_slots"]
    assert "client disconnected" in _logs(server, "frontend")


def test_sigterm_drains_then_stops_every_process(server):
    """Last test of the module: it stops the shared server."""
    async def run():
        async with AsyncClient(server.address) as client:
            events = []
            async for ev in client.stream(prompt="Once upon a time", max_tokens=1500, temperature=0.0, ignore_eos=True):
                events.append(ev)
                if len(events) == 2:
                    server.proc.send_signal(signal.SIGTERM)
            return events

    children = server.children
    run_dir = children[server.pid_of("workers.main")].split("--run-dir ")[1].split()[0]
    start = time.monotonic()
    events = asyncio.run(asyncio.wait_for(run(), 60))
    assert events[-1].finish_reason == "abort"  # did not finish within drain_timeout = 3 s
    assert server.proc.wait(30) == 0
    _all_gone(children, start + 30)
    assert not os.path.exists(run_dir)  # the private sockets are removed on exit


def _all_gone(children: dict[int, str], deadline: float) -> None:
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [cmd for pid, cmd in children.items() if alive(pid)]


async def _stream_until_killed(address: str, kill) -> list:
    """Stream a long request; kill a process after two events; return every event."""
    async with AsyncClient(address, ping_interval=0.5) as client:
        events = []
        async for ev in client.stream(prompt="Once upon a time", max_tokens=1500, temperature=0.0, ignore_eos=True):
            events.append(ev)
            if len(events) == 2:
                kill()
        return events


def _serves_again(address: str, timeout: float) -> float:
    """Seconds until a request succeeds; every failure meanwhile must be an immediate, clear error, and
    no request may be lost (the client hears pongs throughout: only a bound here ends a lost one's wait)."""
    async def run() -> float:
        start = time.monotonic()
        async with AsyncClient(address) as client:
            while True:
                t0 = time.monotonic()
                out = await asyncio.wait_for(client.generate("Hello", max_tokens=2, temperature=0.0), 60)
                if out.finish_reason == "length":
                    return time.monotonic() - start
                assert out.finish_reason == "error" and out.code == "unavailable", out
                assert time.monotonic() - t0 < 5, "a request during the restart waited instead of failing fast"
                assert time.monotonic() - start < timeout, f"not serving {timeout} s after the kill"
                await asyncio.sleep(0.5)

    return asyncio.run(run())


def test_killed_worker_is_restarted(tmp_path):
    srv = start_server(tmp_path, n_workers=2, **{"engine.n_slots": 4096})
    try:
        old = srv.pid_of("--stage 1")
        events = asyncio.run(asyncio.wait_for(_stream_until_killed(srv.address, lambda: os.kill(old, signal.SIGKILL)), 60))
        final = events[-1]
        assert final.finish_reason == "error" and final.code == "unavailable"
        assert "worker" not in final.error and "exit" not in final.error  # no internals to clients
        assert sum(e.finished for e in events) == 1
        _serves_again(srv.address, timeout=180)
        assert srv.proc.poll() is None and srv.pid_of("--stage 1") != old
        assert "serving again (restart 1)" in srv.stderr()
        assert "restarting" in _logs(srv, "launcher")
        settled(srv.address)
    finally:
        srv.stop()


def test_killed_broker_restarts_everything(tmp_path):
    srv = start_server(tmp_path, n_workers=1, **{"engine.n_slots": 4096})
    try:
        broker = srv.pid_of("orca_mq.server.broker")
        events = asyncio.run(asyncio.wait_for(_stream_until_killed(srv.address, lambda: os.kill(broker, signal.SIGKILL)), 120))
        assert events[-1].finished and events[-1].finish_reason == "error" and events[-1].code == "unavailable"
        assert sum(e.finished for e in events) == 1
        _serves_again(srv.address, timeout=180)
        assert srv.pid_of("orca_mq.server.broker") != broker
    finally:
        srv.stop()


def test_crash_loop_stops_the_server(tmp_path):
    srv = start_server(tmp_path, n_workers=1, **{"engine.n_slots": 4096, "server.max_restarts": 0})
    children = srv.children
    os.kill(srv.pid_of("workers.main"), signal.SIGKILL)
    assert srv.proc.wait(60) == 1
    _all_gone(children, time.monotonic() + 30)
    assert "crash loop" in srv.stderr()
