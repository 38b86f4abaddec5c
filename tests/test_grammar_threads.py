"""Where a structured output's constraint costs its time (issue 44, item 7), against a real server (the
tiny model, the embedded tokenizer): the shortest-output search (seconds for a short regex of
Cyrillic letters) runs on the frontend's grammar thread, not its tokenize threads, so a stream of new
constraints delays no one's tokenization; past structured.compile_timeout the search stops, freeing
its thread (before, the thread ran on to the end: the frontend's CPU says which); the scheduler
compiles with the plan the frontend found instead of searching again."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from orca_mq.client import AsyncClient, Client
from orca_mq.config import load_config
from orca_mq.protocol.structured import StructuredOutputsParams as SO
from orca_mq.structured import compiler as compiler_module
from orca_mq.structured.compiler import Compiler, Known
from serving_harness import start_server

# structured.compile_timeout here, far below a slow search on any host: one takes 0.85 s of CPU on the fastest
# host seen (an AVX-512 EPYC), ~3 s on others. With a 1 s timeout the fast host finished the search in time and
# the tests saw a max_tokens refusal, not the timeout. A choice compiles in ~2 ms, far within it.
TIMEOUT = 0.1


def slow(i: int) -> dict:
    return {"regex": f"[\u0400-\u04ff]{{{1800 + i}}}[a-z]{{3}}"}   # distinct: none cached


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_served_dir):
    srv = start_server(tmp_path_factory.mktemp("grammar_threads"), **{
        "model.path": str(tiny_served_dir), "structured.compile_timeout": TIMEOUT})
    with Client(srv.address) as c:   # the vocabulary loads on the first constraint, past the timeout maybe: retried
        deadline = time.monotonic() + 120
        while c.generate("Hi", max_tokens=4, structured_outputs={"choice": ["yes", "no"]}).finish_reason == "error":
            assert time.monotonic() < deadline, "the vocabulary never loaded"
            time.sleep(0.5)
    yield srv
    assert srv.stop() == 0, srv.stderr()[-3000:]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100   # utime + stime, in clock ticks of 1/100 s


def test_tokenization_does_not_wait_behind_shortest_output_searches(server):
    async def run() -> float:
        async with AsyncClient(server.address) as attacker, AsyncClient(server.address) as bystander:
            searches = [asyncio.create_task(attacker.generate("Hi", max_tokens=4, structured_outputs=slow(i)))
                        for i in range(4)]
            await asyncio.sleep(0.2)   # the searches have started
            t = time.monotonic()
            out = await bystander.generate("Hi there", max_tokens=1, temperature=0)
            took = time.monotonic() - t
            assert out.finish_reason == "length", out
            for done in await asyncio.gather(*searches):
                assert done.code == "invalid_request" and "compile_timeout" in done.error, done
            return took

    took = asyncio.run(run())
    assert took < 2.5, f"a plain request took {took:.1f} s beside 4 constraints' searches"


def test_a_search_past_the_compile_timeout_stops(server):
    pid = server.pid_of("orca_mq.server.frontend")
    before = _cpu_s(pid)
    with Client(server.address) as c:
        out = c.generate("Hi", max_tokens=4, structured_outputs=slow(100))
        assert out.code == "invalid_request" and "compile_timeout" in out.error, out
        time.sleep(4.0)   # a search that ran on would still be burning CPU here
    spent = _cpu_s(pid) - before
    assert spent < TIMEOUT + 0.3, f"the frontend spent {spent:.1f} s of CPU on a search refused after {TIMEOUT} s"


def test_the_scheduler_compiles_with_the_plan_the_frontend_found(monkeypatch, tiny_served_dir):
    from orca_mq.admission.served_model import ServedModel
    model = ServedModel(load_config(overrides={"model.path": str(tiny_served_dir)}))
    monkeypatch.setattr(compiler_module, "shortest", lambda *a, **k: pytest.fail("searched again"))
    grammar = model.grammars.compile(SO(regex="ab+"), known=Known([1, 2, 3]))
    assert grammar.start == [1, 2, 3]
    assert isinstance(model.grammars, Compiler) and model.grammars.known(SO(regex="ab+")) == Known([1, 2, 3])
