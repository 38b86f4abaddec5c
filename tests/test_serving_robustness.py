"""Robustness against a real server (embedded model, one worker): garbage frames, an oversize
frame, a huge prompt, load shedding, and a soak of aborts, garbage and vanishing clients.

The server is small on purpose: max_bs 4 and max_waiting 4, so 8 requests fill it.
"""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import zmq

from orca_mq.bench.reliability import SoakConfig, fuzz, garbage_frames, soak
from orca_mq.client import AsyncClient, Client
from orca_mq.protocol import decode, encode
from orca_mq.protocol.client_msgs import TO_CLIENT, Abort, Generate, Output, Ping, Pong, events
from serving_harness import settled, start_server

pytestmark = pytest.mark.e2e
MAX_FRAME = 32 << 20
CAPACITY = 8     # server.max_waiting + scheduler.max_bs x engine.n_workers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("robust"), n_workers=1, **{
        "engine.n_slots": 4096, "scheduler.max_bs": 4, "server.max_waiting": 4, "server.max_frame_bytes": MAX_FRAME})
    yield srv
    srv.stop()


def _rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def _generate_ok(address: str) -> None:
    with Client(address) as c:
        out = c.generate("Hello", max_tokens=2, temperature=0.0, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 2


def test_every_garbage_frame_gets_a_protocol_error(server):
    frames = garbage_frames(random.Random(1), 400)
    result = asyncio.run(fuzz(server.address, frames))
    assert result.errors == {"protocol": len(frames)} and result.other_replies == 0 and result.unanswered == 0
    _generate_ok(server.address)


def test_oversize_frames_are_dropped_before_the_broker_buffers_them(server):
    broker = server.pid_of("orca_mq.server.broker")
    before = _rss_kb(broker)
    ctx = zmq.Context()
    try:
        for i in range(3):  # a valid request, just too big: without ZMQ_MAXMSGSIZE each would be buffered whole
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.address)
            tracker = sock.send(encode(Generate(f"big{i}", prompt="x" * (MAX_FRAME + (16 << 20)))), copy=False, track=True)
            tracker.wait(60)  # ZeroMQ is done with it: written out (and dropped by the broker)
            assert not sock.poll(500), "an oversize frame got an answer: the broker read it"
            sock.close()
    finally:
        ctx.destroy(linger=0)
    time.sleep(0.5)
    assert _rss_kb(broker) - before < 16 << 10, "the broker's memory grew by a frame it should not have read"
    _generate_ok(server.address)


def test_huge_prompt_is_refused_before_tokenizing_and_delays_nobody(server):
    async def run():
        async with AsyncClient(server.address) as client:
            huge = asyncio.create_task(client.generate("word " * (4 << 20), max_tokens=1))  # 20 MB
            long = asyncio.create_task(client.generate("word " * 30_000, max_tokens=1))  # fits the char bound, not the context
            normal = await client.generate("The sky is", max_tokens=3, temperature=0.0, ignore_eos=True)
            return await huge, await long, normal

    huge, long, normal = asyncio.run(run())
    assert huge.finish_reason == "error" and huge.code == "invalid_request" and "characters" in huge.error
    assert long.finish_reason == "error" and long.code == "invalid_request" and "context length" in long.error
    assert normal.finish_reason == "length" and len(normal.token_ids) == 3
    settled(server.address)


def test_past_max_waiting_a_request_is_overloaded_at_once(server):
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        for i in range(CAPACITY + 1):
            sock.send(encode(Generate(f"r{i}", prompt="Count to a thousand:", sampling={"max_tokens": 500, "ignore_eos": True})))
        finals: dict[str, Output] = {}
        while f"r{CAPACITY}" not in finals:
            assert sock.poll(30_000)
            for msg in events(decode(sock.recv(), TO_CLIENT)):
                if isinstance(msg, Output) and msg.finished:
                    finals[msg.request_id] = msg
        assert list(finals) == [f"r{CAPACITY}"], "only the request past capacity may end this early"
        assert finals[f"r{CAPACITY}"].code == "overloaded" and finals[f"r{CAPACITY}"].finish_reason == "error"
        for i in range(CAPACITY):
            sock.send(encode(Abort(f"r{i}")))
        while len(finals) < CAPACITY + 1:
            assert sock.poll(30_000)
            for msg in events(decode(sock.recv(), TO_CLIENT)):
                if isinstance(msg, Output) and msg.finished:
                    assert msg.request_id not in finals and msg.finish_reason == "abort" and msg.code == "aborted"
                    finals[msg.request_id] = msg
    finally:
        ctx.destroy(linger=0)
    stats = settled(server.address)
    assert stats["broker"]["overloaded"] >= 1


def test_soak_exactly_one_final_per_request_and_no_kv_leak(server):
    cfg = SoakConfig(clients=4, requests_per_client=50, concurrency=2, vanishing_clients=3)
    result = asyncio.run(soak(server.address, cfg, seed=3))
    assert result.requests == 200 and result.missing_finals == 0 and result.duplicate_finals == 0
    assert sum(result.finals.values()) == 200 and result.garbage_answered == result.garbage_sent > 0
    assert result.finals.get("length/None", 0) > 0 and result.finals.get("abort/aborted", 0) > 0
    assert set(result.finals) <= {"length/None", "stop/None", "abort/aborted", "error/overloaded"}, result.finals
    stats = settled(server.address)
    assert stats["scheduler"]["free_slots"] == stats["scheduler"]["n_slots"]
    assert asyncio.run(_ping(server.address)).nonce == 5  # a new client is answered


async def _ping(address: str) -> Pong:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    await sock.send(encode(Ping(5)))
    assert await sock.poll(10_000)
    msg = decode(await sock.recv(), TO_CLIENT)
    sock.close()
    ctx.term()
    return msg
