"""The broker process on its own (no model): routing, rejection of bad frames, vanished clients,
failing in-flight requests on `fatal`, finals settled inside per-iteration `outputs` frames,
replies in an older client's protocol version, and each client's fair share of the queue."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from orca_mq.config import Config
from orca_mq.protocol import decode, encode, unpack
from orca_mq.protocol.client_msgs import TO_CLIENT, Final, Generate, Output, Outputs, Ping, Pong, Stats, StatsReply
from orca_mq.protocol.common_msgs import Error
from orca_mq.protocol.codec import channel
from orca_mq.protocol.control_msgs import ClientGone, Fatal, Resume
from orca_mq.server.zmq_queue import BROKER, CLIENT, CLIENTS, PEER
from serving_harness import ROOT, free_port

TIMEOUT_MS = 5000


def _start_broker(tmp_path, **sets):
    """A broker process alone, on a free client port and a private backend socket; `sets`: config keys."""
    cfg = Config()
    for key, value in sets.items():
        cfg.set(key, value)
    cfg.server.frontend_address = f"tcp://127.0.0.1:{free_port()}"
    cfg.server.backend_address = f"ipc://{tmp_path}/backend"
    cfg.log.dir = str(tmp_path / "logs")
    return cfg, subprocess.Popen([sys.executable, "-m", "orca_mq.server.broker", "--config-json", json.dumps(cfg.to_dict())],
                                 cwd=ROOT)


@pytest.fixture()
def broker(tmp_path, request):
    cfg, proc = _start_broker(tmp_path, **getattr(request, "param", {}))
    ctx = zmq.Context()
    frontend = ctx.socket(zmq.DEALER)
    frontend.setsockopt(zmq.ROUTING_ID, b"frontend")
    frontend.connect(cfg.server.backend_address)
    launcher = ctx.socket(zmq.DEALER)
    launcher.setsockopt(zmq.ROUTING_ID, b"launcher")
    launcher.connect(cfg.server.backend_address)
    for sock in (frontend, launcher):  # until the broker knows both identities
        _ping(sock)
    launcher.send_multipart([BROKER, b"", encode(Resume(0))])   # every process ready: it serves
    _ping(launcher)
    yield cfg, ctx, frontend, launcher
    proc.terminate()
    proc.wait(10)
    assert proc.returncode == 0
    ctx.destroy(linger=0)


def _ping(sock):
    """Ping the broker until it answers; drain the late pongs."""
    for _ in range(100):
        sock.send_multipart([BROKER, b"", encode(Ping(1))])
        if sock.poll(200):
            while sock.poll(300):
                sock.recv_multipart()
            return
    raise AssertionError("the broker does not answer")


def _client(ctx, cfg):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cfg.server.frontend_address)
    return sock


def _recv(sock, n_frames=1):
    assert sock.poll(TIMEOUT_MS), "no reply"
    frames = sock.recv_multipart()
    assert len(frames) == n_frames
    return frames


def test_bad_client_frames_get_errors_and_the_broker_survives(broker):
    cfg, ctx, frontend, _ = broker
    client = _client(ctx, cfg)
    for frame in [[b"\xc1garbage"], [encode(Ping(1))[:-1]], [msgpack.packb({"v": 99, "type": "ping", "nonce": 1})],
                  [msgpack.packb({"v": 1, "type": "warp"})], [encode(Ping(1)), b"extra"],
                  [msgpack.packb({"v": 1, "type": "generate", "request_id": "r1", "prompt": "x", "bogus": 1})]]:
        client.send_multipart(frame)
        msg = decode(_recv(client)[0], TO_CLIENT)
        assert isinstance(msg, Error), frame
    assert msg.request_id == "r1"  # the last one named its request: that request is over
    client.send(encode(Ping(7)))
    pong = decode(_recv(client)[0], TO_CLIENT)
    assert isinstance(pong, Pong) and pong.nonce == 7 and pong.server and pong.restarts == 0
    assert not frontend.poll(100), "nothing malformed may reach the frontend"


def test_routing_and_vanished_client(broker):
    cfg, ctx, frontend, _ = broker
    client = _client(ctx, cfg)
    client.send(encode(Generate("r1", prompt="hi")))
    route, cid, payload = _recv(frontend, 3)
    assert route == CLIENT and decode(payload, channel(Generate)).request_id == "r1"
    frontend.send_multipart([CLIENT, cid, encode(Output("r1", [5], "x"))])
    assert decode(_recv(client)[0], TO_CLIENT) == Output("r1", [5], "x")
    client.close()
    time.sleep(0.3)  # the broker's ROUTER notices the TCP close
    frontend.send_multipart([CLIENT, cid, encode(Outputs(["r1"], [[6]], ["y"], [None]))])
    route, _, payload = _recv(frontend, 3)
    assert route == BROKER and decode(payload, channel(ClientGone)) == ClientGone(cid)


def test_unknown_peer_and_bad_envelopes_are_answered(broker):
    _, _, frontend, _ = broker
    frontend.send_multipart([PEER, b"nobody", encode(Ping(1))])
    assert "unreachable" in decode(_recv(frontend, 3)[2], channel(Error)).error
    frontend.send_multipart([b"X", b"", b""])
    assert "envelope" in decode(_recv(frontend, 3)[2], channel(Error)).error
    frontend.send_multipart([CLIENT, b"\x00abcd", encode(Generate("r", prompt="x"))])  # not a client-bound type
    assert isinstance(decode(_recv(frontend, 3)[2], channel(Error)), Error)


def test_fatal_fails_in_flight_requests_and_refuses_new_ones(broker):
    cfg, ctx, frontend, launcher = broker
    client = _client(ctx, cfg)
    client.send(encode(Generate("r1", prompt="hi")))
    _recv(frontend, 3)
    launcher.send_multipart([BROKER, b"", encode(Fatal("worker1 died"))])
    out = decode(_recv(client)[0], TO_CLIENT)
    assert out.request_id == "r1" and out.finished and out.finish_reason == "error" and out.code == "unavailable"
    assert "worker1" not in out.error  # which process, its pid or exit code: the logs', not the client's
    client.send(encode(Generate("r2", prompt="hi")))
    out = decode(_recv(client)[0], TO_CLIENT)
    assert out.request_id == "r2" and out.finish_reason == "error"
    assert not frontend.poll(100)


def _tracked(client, frontend):
    """The broker's count of requests without a final, from a stats reply passing through it."""
    client.send(encode(Stats("q")))
    _, cid, _ = _recv(frontend, 3)
    frontend.send_multipart([CLIENT, cid, encode(StatsReply("q", {}))])
    return decode(_recv(client)[0], TO_CLIENT).stats["broker"]["tracked_requests"]


def test_finals_inside_batched_frames_settle_their_requests(broker):
    cfg, ctx, frontend, launcher = broker
    client = _client(ctx, cfg)
    for rid in ("r1", "r2", "r3"):
        client.send(encode(Generate(rid, prompt="hi")))
        _, cid, _ = _recv(frontend, 3)
    assert _tracked(client, frontend) == 3
    batch = Outputs(["r1", "r2", "r3"], [[5], [6], []], ["a", "b", ""], [None, Final("length"), Final("abort", code="aborted")])
    frontend.send_multipart([CLIENT, cid, encode(batch)])
    assert decode(_recv(client)[0], TO_CLIENT) == batch
    assert _tracked(client, frontend) == 1
    launcher.send_multipart([BROKER, b"", encode(Fatal("worker0 died"))])
    out = decode(_recv(client)[0], TO_CLIENT)  # only the one still in flight gets the error final
    assert out.request_id == "r1" and out.finish_reason == "error" and out.code == "unavailable"
    assert not client.poll(200)


def test_an_older_client_is_answered_in_its_version(broker):
    """A v3 client cannot read a v4 frame: the broker's own replies (pong, errors, the finals it
    writes on `fatal`) are written in the version the client used."""
    cfg, ctx, frontend, launcher = broker
    client = _client(ctx, cfg)
    client.send(encode(Ping(3), 3))
    assert unpack(_recv(client)[0])["v"] == 3
    client.send(encode(Generate("r1", prompt="hi"), 3))
    _, _, payload = _recv(frontend, 3)
    assert unpack(payload)["v"] == 3   # forwarded as written: the frontend answers in v3 too
    client.send(encode(Generate("r1", prompt="hi"), 3))
    reply = unpack(_recv(client)[0])
    assert reply["v"] == 3 and reply["type"] == "error" and reply["code"] == "invalid_request"
    launcher.send_multipart([BROKER, b"", encode(Fatal("worker0 died"))])
    final = unpack(_recv(client)[0])
    assert final["v"] == 3 and final["type"] == "output" and final["request_id"] == "r1" and final["finished"]


def test_one_message_carries_frames_for_many_clients(broker):
    """The frontend's frames of one iteration travel as one message (CLIENTS); a bad one among them is
    answered alone, the others are delivered and settle their requests."""
    cfg, ctx, frontend, _ = broker
    clients, cids = [_client(ctx, cfg) for _ in range(2)], []
    for i, client in enumerate(clients):
        client.send(encode(Generate(f"r{i}", prompt="hi")))
        cids.append(_recv(frontend, 3)[1])
    frames = [encode(Outputs([f"r{i}"], [[i]], ["x"], [Final("length")])) for i in range(2)]
    frontend.send_multipart([CLIENTS, cids[0], frames[0], cids[1], encode(Ping(1)), cids[1], frames[1]])
    for i, client in enumerate(clients):
        assert decode(_recv(client)[0], TO_CLIENT) == Outputs([f"r{i}"], [[i]], ["x"], [Final("length")])
    assert "not a client message" in decode(_recv(frontend, 3)[2], channel(Error)).error
    assert _tracked(clients[0], frontend) == 0


def test_until_resumed_the_broker_says_starting_then_restarting(tmp_path):
    """A frontend can be up before its scheduler (CI once lost a request to that window after a restart:
    the frontend's frame to the absent scheduler went nowhere and the client waited forever). Until the
    launcher's `resume` the broker refuses requests and stats queries itself, as `starting`; once it
    served and its frontend is gone, as a restart after a failure."""
    cfg, proc = _start_broker(tmp_path)
    ctx = zmq.Context()
    try:
        client = _client(ctx, cfg)
        frontend, launcher = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock, name in ((frontend, b"frontend"), (launcher, b"launcher")):
            sock.setsockopt(zmq.ROUTING_ID, name)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(cfg.server.backend_address)
            _ping(sock)
        client.send(encode(Generate("r1", prompt="hi")))
        first = decode(_recv(client)[0], TO_CLIENT)
        assert (first.finish_reason, first.code) == ("error", "unavailable") and "starting" in first.error, first
        client.send(encode(Stats("q")))
        refused = decode(_recv(client)[0], TO_CLIENT)
        assert isinstance(refused, Error) and refused.code == "unavailable" and "starting" in refused.error
        assert not frontend.poll(100), "nothing reaches a frontend before the launcher says every process is ready"
        launcher.send_multipart([BROKER, b"", encode(Resume(0))])
        _ping(launcher)
        client.send(encode(Generate("r2", prompt="hi")))
        assert decode(_recv(frontend, 3)[2], channel(Generate)).request_id == "r2"
        frontend.close()
        time.sleep(0.3)  # the broker's ROUTER notices the close
        client.send(encode(Generate("r3", prompt="hi")))
        later = decode(_recv(client)[0], TO_CLIENT)
        assert later.code == "unavailable" and "restarting after a failure" in later.error, later
    finally:
        proc.terminate()
        proc.wait(10)
        ctx.destroy(linger=0)
    assert proc.returncode == 0


@pytest.mark.parametrize("broker", [{"server.max_waiting": 28, "scheduler.max_bs": 4, "server.client_headroom": 0.0625}],
                         indirect=True)
def test_no_client_takes_the_queue_another_needs(broker):
    """Issue 44: one client's flood filled the queue and every other client got `overloaded`. A client
    now stops short of the last server.client_headroom of it (2 of 32 here) unless within its fair
    share, so another client's request, and a gateway's end client's (on_behalf_of), still get in."""
    cfg, ctx, frontend, _ = broker
    flood, other, gateway = _client(ctx, cfg), _client(ctx, cfg), _client(ctx, cfg)
    for i in range(40):
        flood.send(encode(Generate(f"f{i}", prompt="hi")))
    refused = [decode(_recv(flood)[0], TO_CLIENT) for _ in range(10)]
    assert all(r.code == "overloaded" and "share" in r.error for r in refused)
    forwarded = 0
    while frontend.poll(500):
        frontend.recv_multipart()
        forwarded += 1
    assert forwarded == 30
    other.send(encode(Generate("o1", prompt="hi")))
    assert decode(_recv(frontend, 3)[2], channel(Generate)).request_id == "o1"
    gateway.send(encode(Generate("g-x", prompt="hi", on_behalf_of="x")))
    assert decode(_recv(frontend, 3)[2], channel(Generate)).on_behalf_of == "x"
    gateway.send(encode(Generate("g-y", prompt="hi", on_behalf_of="y")))   # 32 of 32: full for everyone
    out = decode(_recv(gateway)[0], TO_CLIENT)
    assert out.code == "overloaded" and "share" not in out.error
