"""The control plane paid per iteration (issue 32, item 4), end to end on a real server with a tiny
model: a v4 client gets one `outputs` frame per iteration for all its requests, a v3 client (which
knows only `output`) is still served in its version, every request ends with exactly one final under
aborts, the broker holds nothing after a burst, and no process logs a line per token."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from orca_mq.client import AsyncClient, Client
from orca_mq.protocol import encode, unpack
from orca_mq.protocol.client_msgs import Abort, Generate, Ping, Stats
from orca_mq.tokenizer import load_tokenizer
from serving_harness import settled, start_server

PROMPT = [504, 3575, 282, 4649, 314]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_served_dir):
    srv = start_server(tmp_path_factory.mktemp("batched"), **{"model.path": str(tiny_served_dir), "scheduler.max_bs": 16,
                                                                "model.max_model_len": 128})
    srv.tokenizer = load_tokenizer(str(tiny_served_dir))
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


@pytest.fixture()
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


class Raw:
    """A client written against the wire: frames in one protocol version, replies kept as raw maps."""

    def __init__(self, ctx: zmq.Context[Any], address: str, version: int) -> None:
        self.version = version
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, msg: Any) -> None:
        self.sock.send(encode(msg, self.version))

    def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.sock.poll(int(timeout * 1000)), "no reply"
        return unpack(self.sock.recv())

    def generate(self, rid: str, **sampling: Any) -> None:
        self.send(Generate(rid, prompt_token_ids=PROMPT, sampling={"temperature": 0.0, "ignore_eos": True, **sampling}))


def _rows(body: dict[str, Any]) -> list[tuple[str, list[int], str, Any]]:
    """A v4 frame's rows as (request id, new tokens, new text, final map or None); a v3 `output` is one row."""
    if body["type"] == "outputs":
        finals = [None if f is None else dict(zip(("finish_reason", "error", "metrics", "code"), f)) for f in body["finals"]]
        return list(zip(body["request_ids"], body["token_ids"], body["texts"], finals))
    assert body["type"] == "output", body
    final = {k: body.get(k) for k in ("finish_reason", "error", "metrics", "code")} if body["finished"] else None
    return [(body["request_id"], body["token_ids"], body["text"], final)]


def _collect(raw: Raw, rids: set[str], after_first: Callable[[], None] = lambda: None
             ) -> tuple[dict[str, list[int]], dict[str, str], dict[str, list[dict[str, Any]]], list[int]]:
    """Every frame until each of `rids` has a final, then a quiet moment: (tokens, text and finals per
    request, rows per frame); `after_first` runs once the first frame is in."""
    ids: dict[str, list[int]] = {r: [] for r in rids}
    text: dict[str, str] = {r: "" for r in rids}
    finals: dict[str, list[dict[str, Any]]] = {r: [] for r in rids}
    sizes: list[int] = []
    deadline = time.monotonic() + 60
    while not all(finals.values()) or raw.sock.poll(300):
        assert time.monotonic() < deadline, finals
        body = raw.recv()
        assert body["v"] == raw.version, body
        rows = _rows(body)
        if not sizes:
            after_first()
        sizes.append(len(rows))
        for rid, new, piece, final in rows:
            assert not finals[rid], f"{rid}: a row after its final"
            ids[rid] += new
            text[rid] += piece
            if final is not None:
                finals[rid].append(final)
    return ids, text, finals, sizes


def test_one_frame_per_iteration_and_one_final_per_request_under_aborts(server, ctx):
    raw = Raw(ctx, server.address, 4)
    rids = {f"r{i}" for i in range(12)}
    for rid in sorted(rids):
        raw.generate(rid, max_tokens=MAX_TOKENS)
    raw.send(Abort("r11"))                 # most likely before it is admitted
    ids, text, finals, sizes = _collect(raw, rids, lambda: [raw.send(Abort(r)) for r in ("r0", "r1", "r2", "r3")])
    assert all(len(f) == 1 for f in finals.values()), finals
    assert max(sizes) > 1 and len(sizes) < sum(map(len, ids.values())), "tokens of one iteration share a frame"
    for rid in rids:
        final = finals[rid][0]
        if rid in ("r0", "r1", "r2", "r3", "r11") and final["finish_reason"] == "abort":
            assert final["code"] == "aborted" and len(ids[rid]) < MAX_TOKENS
        else:
            assert final["finish_reason"] == "length" and len(ids[rid]) == MAX_TOKENS, (rid, final)
            assert final["metrics"]["completion_tokens"] == MAX_TOKENS
        assert text[rid] == server.tokenizer.decode(ids[rid], skip_special_tokens=True)
    assert settled(server.address)["broker"]["tracked_requests"] == 0


def test_a_v3_client_is_served_in_its_version(server, ctx):
    """A client of protocol v3 knows no `outputs` and rejects any v4 frame: it gets per-request `output`
    frames, every reply (pong, stats, errors) in v3, and the same tokens as a v4 client."""
    raw = Raw(ctx, server.address, 3)
    raw.send(Ping(1))
    assert raw.recv()["type"] == "pong"
    raw.generate("a", max_tokens=MAX_TOKENS)
    raw.generate("b", max_tokens=MAX_TOKENS)
    raw.generate("bad", max_tokens=0)
    ids, text, finals, sizes = _collect(raw, {"a", "b", "bad"})
    assert set(sizes) == {1}
    assert finals["bad"][0]["code"] == "invalid_request" and not ids["bad"]
    with Client(server.address) as client:
        out = client.generate(prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for rid in ("a", "b"):
        assert finals[rid][0]["finish_reason"] == "length" and ids[rid] == out.token_ids and text[rid] == out.text
    raw.send(Stats("q"))
    reply = raw.recv()
    assert reply["type"] == "stats_reply" and reply["stats"]["broker"]["tracked_requests"] == 0


def _log_lines(server) -> int:
    return sum(len(p.read_text().splitlines()) for p in Path(server.log_dir).glob("*.log")
               if p.stem in ("broker", "frontend", "scheduler"))


def test_offline_metrics_are_the_servers(server, tiny_served_dir):
    """The offline LLM's outputs carry the metrics the server's final message does, made by the same code
    (issue 43: offline they were None but for structured outputs): the same keys, the same counts."""
    from orca_mq import LLM, SamplingParams

    prompt = [911, 912, 913, 914, 915]   # its own: nothing of it in the server's prefix cache
    with Client(server.address) as c:
        served = c.generate(prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True).metrics
    llm = LLM(str(tiny_served_dir), dtype="float32", max_bs=16, max_model_len=128, progress=False)
    offline = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].metrics
    assert served.keys() == offline.keys() and served["scheduler"] == offline["scheduler"] == {"cached_tokens": 0,
                                                                                               "iterations": 6}
    for m in (served, offline):
        assert (m["prompt_tokens"], m["completion_tokens"]) == (5, 6), m
        assert m["arrival_time"] <= m["first_token_time"] <= m["finish_time"] and min(m["ttft"], m["tpot"], m["e2e_latency"]) > 0
        assert abs(m["finish_time"] - time.time()) < 600, m   # wall-clock times, as the server's


def test_no_log_line_per_token(server):
    """A burst of 8 requests x 24 tokens adds a few lines per request to the serving processes' logs, none per token."""
    settled(server.address)
    before = _log_lines(server)

    async def burst() -> list[Any]:
        async with AsyncClient(server.address) as client:
            return await asyncio.gather(*(client.generate(prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                                          ignore_eos=True) for _ in range(8)))

    assert all(o.finish_reason == "length" for o in asyncio.run(burst()))
    settled(server.address)
    assert _log_lines(server) - before <= 3 * 8



def test_a_server_is_ready_for_constrained_requests_before_one_arrives(server):
    """What the first constrained request paid on the loops of the processes that compile it (issue 44):
    the grammars' vocabulary, built by llguidance holding the GIL for a few tenths of a second, stalled
    every other request's turn there. Each builds it on its grammar thread once ready; none was sent
    one here."""
    deadline = time.monotonic() + 60
    for role in ("scheduler", "frontend"):
        while "vocabulary ready" not in (Path(server.log_dir) / f"{role}.log").read_text():
            assert time.monotonic() < deadline, f"the {role} did not build the grammars' vocabulary once ready"
            time.sleep(0.1)


def test_the_workers_idle_openmp_threads_spin_briefly_and_keep_freed_memory(server):
    """engine.omp_spin_count reaches the worker as libgomp's GOMP_SPINCOUNT (read when torch loads it):
    libgomp's own 300,000 spins kept a core busy between iterations that the server's other processes
    need (issue 44: the bystander's tail under load); engine.malloc_top_pad as glibc's MALLOC_TOP_PAD_
    (read at the first malloc): with glibc's own, each iteration's logits came back as fresh pages."""
    environ = Path(f"/proc/{server.pid_of('workers.main')}/environ").read_bytes().split(b"\0")
    assert b"GOMP_SPINCOUNT=3000" in environ and f"MALLOC_TOP_PAD_={64 << 20}".encode() in environ
