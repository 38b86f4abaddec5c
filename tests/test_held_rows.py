"""A request that does not stream (protocol v11 `generate.stream` False): the frontend holds its rows and
its final carries them all (orca_mq.server.held_rows). Over a real server (a tiny random Llama with the
embedded tokenizer): one event, with the same tokens, text, log probabilities and prompt log probabilities
as the same request streamed; an abort still ends it with what it had. The hold's bound, unit-tested."""
from __future__ import annotations

import asyncio

import pytest

import orca_mq.server.held_rows as held_rows
from orca_mq.assembly import Row
from orca_mq.client import AsyncClient
from orca_mq.protocol.client_msgs import Final
from orca_mq.protocol.logprobs import Logprobs
from orca_mq.server.held_rows import HeldRows
from serving_harness import start_server

PROMPT = list(range(300, 316))


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_served_dir):
    srv = start_server(tmp_path_factory.mktemp("held"), **{"model.path": str(tiny_served_dir), "model.max_model_len": 256})
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
    assert len(streamed) > 1 and len(held) == 1 and held[0].finished and held[0].finish_reason == "length"
    assert _joined(held) == _joined(streamed)
    assert len(_joined(held)[0]) == 24 and held[0].metrics["completion_tokens"] == 24


def test_an_aborted_held_request_ends_once_with_what_it_had(served):
    async def run() -> list:
        async with AsyncClient(served.address) as client:
            events = []
            async for ev in client.stream(prompt_token_ids=PROMPT, stream=False, max_tokens=200, ignore_eos=True):
                events.append(ev)
            return events

    async def abort_soon() -> list:
        async with AsyncClient(served.address) as client:
            gen = client.stream(prompt_token_ids=PROMPT, stream=False, max_tokens=240, ignore_eos=True, request_id="held-abort")
            task = asyncio.create_task(_drain(gen))
            await asyncio.sleep(0.05)   # 240 tokens take ~0.4 s here
            await client.abort("held-abort")
            return await task

    events = asyncio.run(abort_soon())
    assert len(events) == 1 and events[0].finish_reason == "abort"
    assert len(events[0].token_ids) == (events[0].metrics or {}).get("completion_tokens", 0) < 240
    assert len(asyncio.run(run())[0].token_ids) == 200   # the server is whole


async def _drain(gen) -> list:
    return [ev async for ev in gen]


def _row(ids: list[int], final: Final | None = None, k: int = 0, prompt: Logprobs | None = None) -> Row:
    lp = Logprobs(ids, [str(i) for i in ids], [-1.0] * len(ids), [[0] * k for _ in ids], [["a"] * k for _ in ids],
                  [[-2.0] * k for _ in ids]) if k else None
    return Row(ids, "".join(map(str, ids)), final, lp, prompt, None)


def test_the_hold_goes_at_its_bound_and_keeps_the_prompts(monkeypatch):
    monkeypatch.setattr(held_rows, "FRAME_ENTRIES", 10)
    hold, prompt = HeldRows(), Logprobs([7], ["7"], [None], [[]], [[]], [[]])
    assert hold.add(_row([1], k=2, prompt=prompt)) is None            # 1 token + 1 position + 2 alternatives + 1
    assert hold.add(_row([2], k=2)) is None                            # 8
    out = hold.add(_row([3], k=2))                                     # 12: past the bound, sent without a final
    assert out is not None and out.final is None and out.token_ids == [1, 2, 3] and out.text == "123"
    assert out.prompt_logprobs is prompt and out.logprobs.token_ids == [1, 2, 3] and hold.weight == 0
    final = Final("length")
    last = hold.add(_row([4], final, k=2))
    assert last.final is final and last.token_ids == [4] and last.prompt_logprobs is None and last.logprobs.token_ids == [4]
