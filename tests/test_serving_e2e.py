"""End to end on the embedded model, with 1 and 2 workers and with one worker scheduling ahead
(async scheduling, the graph path's buffers): the served greedy tokens equal the
offline engine's, requests join mid-run and leave early, the scheduler's record is
iteration-level FCFS, and no KV slot is left in use."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from orca_mq import LLM, SamplingParams
from orca_mq.client import AsyncClient, Client
from serving_harness import ROOT, start_server

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Q: What is the boiling point of water at sea level?\nA:",
]
MAX_TOKENS = [6, 10, 4, 8, 5]
CHAT = "What is the capital of Japan? Answer in one word."
SERVER = {"scheduler.max_bs": 4, "engine.n_slots": 4096}


@pytest.fixture(scope="module")
def reference():
    llm = LLM(max_bs=4, n_slots=4096, dtype="float32")
    greedy = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, greedy)
    chat = llm.chat([{"role": "user", "content": CHAT}], SamplingParams(max_tokens=12, temperature=0.0))[0]
    return {"tokens": [o.token_ids for o in outs], "texts": [o.text for o in outs], "chat": chat, "tokenizer": llm.tokenizer}


# "ahead": one worker with async scheduling and the graph path's padded buffers (on the CPU: no capture)
AHEAD = {"scheduler.async_scheduling": "on", "engine.cuda_graphs": "on"}


@pytest.fixture(scope="module", params=[1, 2, "ahead"], ids=["1worker", "2workers", "1worker-ahead"])
def server(request, tmp_path_factory, reference):
    workers, extra = (1, AHEAD) if request.param == "ahead" else (request.param, {})
    srv = start_server(tmp_path_factory.mktemp(f"srv{request.param}"), n_workers=workers, **SERVER, **extra)
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


async def _collect(client, **kwargs):
    events = []
    async for ev in client.stream(**kwargs):
        events.append(ev)
    return events


def test_concurrent_greedy_matches_offline(server, reference):
    async def run():
        async with AsyncClient(server.address) as client:
            plain = [_collect(client, prompt=p, max_tokens=m, temperature=0.0, ignore_eos=True)
                     for p, m in zip(PROMPTS, MAX_TOKENS)]
            chat = _collect(client, prompt=CHAT, chat=True, max_tokens=12, temperature=0.0)
            return await asyncio.gather(*plain, chat)

    *results, chat = asyncio.run(run())
    tok = reference["tokenizer"]
    for events, want, want_text in zip(results, reference["tokens"], reference["texts"]):
        final = events[-1]
        assert final.finished and final.finish_reason == "length" and final.error is None
        assert all(not e.finished for e in events[:-1])
        ids = [t for e in events for t in e.token_ids]
        assert ids == want
        text = "".join(e.text for e in events)
        assert text == want_text == tok.decode(ids, skip_special_tokens=True)
        assert final.metrics["completion_tokens"] == len(want) and final.metrics["ttft"] > 0
    ref = reference["chat"]
    assert [t for e in chat for t in e.token_ids] == ref.token_ids
    assert "".join(e.text for e in chat) == ref.text and chat[-1].finish_reason == ref.finish_reason


def test_short_request_joins_mid_run_and_returns_first(server):
    k = 3  # tokens of the long request seen before the short one is sent

    async def run():
        async with AsyncClient(server.address) as client:
            order = []
            joined = asyncio.Event()

            async def long():
                n = 0
                async for ev in client.stream(prompt="Write a long story about the sea.", request_id="long",
                                              max_tokens=40, temperature=0.0, ignore_eos=True):
                    n += len(ev.token_ids)
                    if n == k:
                        joined.set()
                    if ev.finished:
                        order.append("long")

            async def short():
                await joined.wait()
                out = await client.generate(prompt="Hi", request_id="short", max_tokens=3, temperature=0.0, ignore_eos=True)
                order.append("short")
                return out

            _, out = await asyncio.gather(long(), short())
            return order, out, await client.stats(record=True)

    order, out, stats = asyncio.run(run())
    assert order == ["short", "long"] and out.finish_reason == "length" and len(out.token_ids) == 3
    record = stats["record"]
    long_its = [it for it, rids in record if "long" in rids]
    short_its = [it for it, rids in record if "short" in rids]
    assert len(long_its) == 40 and len(short_its) == 3
    assert long_its[0] < short_its[0] and short_its[-1] < long_its[-1]
    # joined at the next iteration: the long request ran at most the k seen, the one in flight
    # per pipeline stage, and one racing the arrival before the short one was scheduled
    assert sum(it < short_its[0] for it in long_its) <= k + server_workers(stats) + 1


def server_workers(stats):
    return len(stats["workers"])


def test_iteration_level_fcfs_from_scheduler_record(server):
    n = 7  # more than max_bs: later requests wait, then join as earlier ones leave

    async def run():
        async with AsyncClient(server.address) as client:
            outs = await asyncio.gather(*(client.generate(prompt_token_ids=[100 + i] * (3 + i), request_id=f"fcfs{i}",
                                                          max_tokens=2 + (i * 3) % 5, temperature=0.0, ignore_eos=True)
                                          for i in range(n)))
            return outs, await client.stats(record=True)

    outs, stats = asyncio.run(run())
    assert all(o.finish_reason == "length" for o in outs)
    order = [r for r in stats["arrival_order"] if r.startswith("fcfs")]
    assert sorted(order) == sorted(f"fcfs{i}" for i in range(n))
    record = [(it, [r for r in rids if r.startswith("fcfs")]) for it, rids in stats["record"]]
    total = {r: sum(r in rids for _, rids in record) for r in order}
    assert max(len(rids) for _, rids in record) <= SERVER["scheduler.max_bs"]
    done = dict.fromkeys(order, 0)
    for _, rids in record:
        for r in rids:
            done[r] += 1
        for i, early in enumerate(order):
            for late in order[i + 1:]:
                # an earlier request has run at least as many iterations as a later one, unless it is finished
                assert done[early] >= done[late] or done[early] == total[early], (early, late, done)


def test_cli_and_sync_client(server, reference):
    cli = subprocess.run([sys.executable, str(ROOT / "tools" / "client.py"), "--prompt", PROMPTS[0], "--max-tokens",
                          str(MAX_TOKENS[0]), "--temperature", "0", "--ignore-eos", "--json", "--address", server.address],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout.strip().splitlines()[-1])
    assert set(out) == {"request_id", "text", "token_ids", "finish_reason"}
    assert out["token_ids"] == reference["tokens"][0] and out["text"] == reference["texts"][0]
    streamed = subprocess.run([sys.executable, str(ROOT / "tools" / "client.py"), "--prompt", PROMPTS[0], "--max-tokens",
                               str(MAX_TOKENS[0]), "--temperature", "0", "--ignore-eos", "--address", server.address],
                              capture_output=True, text=True, timeout=120)
    assert streamed.stdout == reference["texts"][0] + "\n"
    with Client(server.address) as client:
        assert client.generate(PROMPTS[3], max_tokens=MAX_TOKENS[3], temperature=0.0, ignore_eos=True).token_ids \
            == reference["tokens"][3]
        for ev in client.stream(PROMPTS[1], max_tokens=50, temperature=0.0, ignore_eos=True):
            break  # leaving the stream aborts the request


def test_no_kv_slot_leaked(server):
    with Client(server.address) as client:
        for _ in range(50):
            stats = client.stats()
            if stats["frontend"]["active_requests"] == 0 and not stats["scheduler"]["has_work"]:
                break
    s = stats["scheduler"]
    assert s["used_slots"] == 0 and s["free_slots"] == s["n_slots"] and s["reserved_slots"] == 0, s
    assert stats["workers"][-1]["iterations"] > 0
