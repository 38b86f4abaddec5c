"""A request that does not stream (protocol v11 `generate.stream` False): the frontend sends its first row
at once and holds the rest for its final (orca_mq.server.held_rows). Over a real server (a tiny random Llama
with the embedded tokenizer): the same tokens, text, log probabilities and prompt log probabilities as the
same request streamed, in a few events; an abort still ends it once with what it had; an HTTP request's
choices of one prompt still run together; a client killed mid-request is found within about a second (its
request's empty row each second is the send that fails). The hold's bounds (entries, time), unit-tested."""
from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime

import httpx
import pytest

import orca_mq.server.held_rows as held_rows
from orca_mq.assembly import Row
from orca_mq.client import AsyncClient
from orca_mq.protocol.client_msgs import Final
from orca_mq.protocol.logprobs import Logprobs
from orca_mq.server.held_rows import HeldRows
from serving_harness import free_port, settled, start_server

PROMPT = list(range(300, 316))


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_served_dir):
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("held"), **{"model.path": str(tiny_served_dir), "model.max_model_len": 256,
                                                           "server.http_address": f"127.0.0.1:{port}"})
    srv.base_url = f"http://127.0.0.1:{port}"
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


async def _events(address: str, stream: bool, **kwargs) -> list:
    async with AsyncClient(address) as client:
        return [ev async for ev in client.stream(prompt_token_ids=PROMPT, stream=stream, **kwargs)]


def _joined(events: list) -> tuple:
    lp, plp = Logprobs(), None
    for ev in events:
        if ev.logprobs is not None:
            lp.extend(ev.logprobs)
        plp = ev.prompt_logprobs or plp
    return [t for ev in events for t in ev.token_ids], "".join(ev.text for ev in events), lp, plp


def test_a_held_request_gets_everything_with_its_final(served):
    ask = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "logprobs": 3, "prompt_logprobs": 2}
    streamed, held = (asyncio.run(_events(served.address, s, **ask)) for s in (True, False))
    assert len(streamed) == 24 and 2 <= len(held) < 24 and held[-1].finish_reason == "length"   # and an empty row a second
    assert not held[0].finished and held[0].prompt_logprobs is not None
    assert _joined(held) == _joined(streamed)
    assert len(_joined(held)[0]) == 24 and held[-1].metrics["completion_tokens"] == 24


def test_an_aborted_held_request_ends_once_with_what_it_had(served):
    async def abort_after_the_first_row() -> list:
        async with AsyncClient(served.address) as client:
            events = []
            async for ev in client.stream(prompt_token_ids=PROMPT, stream=False, max_tokens=240, ignore_eos=True,
                                          request_id="held-abort"):
                if not events:
                    await client.abort("held-abort")   # 240 tokens take ~0.4 s here: it is running
                events.append(ev)
            return events

    events = asyncio.run(abort_after_the_first_row())
    assert [ev.finished for ev in events] == [False] * (len(events) - 1) + [True] and events[-1].finish_reason == "abort"
    assert 0 < sum(len(ev.token_ids) for ev in events) == events[-1].metrics["completion_tokens"] < 240
    assert sum(len(ev.token_ids) for ev in asyncio.run(_events(served.address, False, max_tokens=240, ignore_eos=True))) == 240


def test_an_http_requests_choices_of_one_prompt_run_together(served):
    """Its later choices wait for the first one's first row (to read the prompt from the prefix cache):
    held, that row still comes at once, so every choice is admitted before any has finished."""
    body = {"model": None, "prompt": PROMPT, "n": 3, "max_tokens": 120, "ignore_eos": True}
    r = httpx.post(served.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    lines = [json.loads(line) for line in (served.log_dir / "frontend.log").read_text().splitlines()]
    ids = {line["request_id"] for line in lines if line.get("event") == "request admitted" and line.get("max_tokens") == 120}
    assert len(ids) == 3
    events = [(line["ts"], line["event"]) for line in lines if line.get("request_id") in ids]
    first_finish = min(ts for ts, event in events if event == "request finished")
    assert all(ts < first_finish for ts, event in events if event == "request admitted")


def _row(ids: list[int], final: Final | None = None, k: int = 0, prompt: Logprobs | None = None) -> Row:
    lp = Logprobs(ids, [str(i) for i in ids], [-1.0] * len(ids), [[0] * k for _ in ids], [["a"] * k for _ in ids],
                  [[-2.0] * k for _ in ids]) if k else None
    return Row(ids, "".join(map(str, ids)), final, lp, prompt, None)


def test_the_hold_goes_at_its_bounds_and_keeps_the_prompts(monkeypatch):
    monkeypatch.setattr(held_rows, "HOLD_ENTRIES", 10)
    hold, prompt = HeldRows(), Logprobs([7], ["7"], [None], [[]], [[]], [[]])
    first = hold.add(_row([1], k=2, prompt=prompt), 0.0)                # the first row goes at once
    assert first is not None and first.token_ids == [1] and first.prompt_logprobs is prompt and hold.weight == 0
    assert hold.add(_row([2], k=2), 0.1) is None                          # 1 token + 1 position + 2 alternatives: 4
    assert hold.add(_row([3], k=2), 0.2) is None                          # 8
    out = hold.add(_row([4], k=2), 0.3)                                   # 12: past the bound, sent without a final
    assert out is not None and out.final is None and out.token_ids == [2, 3, 4] and out.text == "234"
    assert out.prompt_logprobs is None and out.logprobs.token_ids == [2, 3, 4] and hold.weight == 0
    assert hold.add(_row([5]), 0.4) is None
    alive = hold.add(_row([6]), 0.3 + held_rows.HOLD_S)                  # a second after the last send: an empty row
    assert alive is not None and (alive.token_ids, alive.text, alive.final, alive.logprobs) == ([], "", None, None)
    assert hold.add(_row([7]), 0.4 + held_rows.HOLD_S) is None
    final = Final("length")
    last = hold.add(_row([8], final, k=2), 1.5)
    assert last.final is final and last.token_ids == [5, 6, 7, 8] and last.text == "5678" and last.logprobs.token_ids == [8]


def test_a_vanished_clients_held_request_ends_soon(tmp_path):
    """The broker finds a vanished client when a send to it fails: a held request's empty row each second
    is that send, so a client killed mid-request has its request aborted, not run to max_tokens for nobody."""
    import subprocess
    import sys

    from orca_mq.bench.random_models import random_llama

    model = random_llama(tmp_path / "model", layers=2, max_positions=4096)
    srv = start_server(tmp_path / "srv", **{"model.path": str(model), "model.max_model_len": 4096})
    try:
        script = ("import asyncio, sys, time\nfrom orca_mq.client import AsyncClient\n"
                  "async def main():\n"
                  f"    async with AsyncClient({srv.address!r}) as c:\n"
                  "        async for ev in c.stream(prompt_token_ids=[5, 6, 7], stream=False, max_tokens=4000, ignore_eos=True,\n"
                  "                                 request_id='vanishing'):\n"
                  "            print('first', flush=True)\n"
                  "            time.sleep(600)\n"
                  "asyncio.run(main())\n")
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "first"   # running: 4,000 tokens take several seconds here
        finally:
            proc.kill()
            proc.wait(30)
        killed = time.time()
        log = srv.log_dir / "frontend.log"
        gone: list = []
        while not gone and time.time() < killed + 60:
            time.sleep(0.1)
            gone = [line for line in map(json.loads, log.read_text().splitlines())
                    if line.get("event") == "client disconnected; aborting its requests"]
        assert gone and gone[0]["requests"] == 1
        found = datetime.fromisoformat(gone[0]["ts"].replace("Z", "+00:00")).timestamp() - killed
        assert found < 2 * held_rows.HOLD_S, found   # its next empty row; not its 2,048-token row (~2.8 s here) nor its end
        settled(srv.address)
    finally:
        assert srv.stop() == 0, srv.stderr()[-3000:]
