"""The scheduler process's turn after a grammar compiles (issue 44, item 7): a request whose admission
fails there gets its error final, and a failed step ends the process (whose restart gives every
request in flight its final), as a failed turn of its loops does; before, both were lost in the
compile task, the request left without a final. Run in-process on the tiny model, the fault
injected where no input reaches today (the frontend validated the request)."""
from __future__ import annotations

import asyncio

import pytest

from orca_mq.config import load_config
from orca_mq.logs import setup_logging
from orca_mq.protocol import decode
from orca_mq.protocol.codec import channel
from orca_mq.protocol.engine_msgs import AddRequest, TokenBatch
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.protocol.structured import StructuredOutputsParams
from orca_mq.server.scheduler_process import SchedulerProcess
from orca_mq.server.zmq_queue import serve

ADD = AddRequest("r1", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")))


@pytest.fixture
def proc(tmp_path, tiny_served_dir):
    cfg = load_config(overrides={"model.path": str(tiny_served_dir), "log.dir": str(tmp_path / "logs"),
                                 "server.backend_address": f"ipc://{tmp_path}/backend", "server.http_address": ""})
    p = SchedulerProcess(cfg, str(tmp_path))
    sent: list[bytes] = []

    async def send_raw(route: bytes, address: bytes, payload: bytes) -> None:
        sent.append(payload)

    p.link.send_raw = send_raw   # type: ignore[method-assign]
    p.sent = sent   # type: ignore[attr-defined]
    yield p
    p.grammar_pool.shutdown(wait=True)
    p.link.close()
    p.control.close()
    p.results.close()
    p.ctx.term()


def test_a_request_refused_after_its_grammar_compiles_gets_its_final(proc):
    def refuse(req):
        raise RuntimeError("injected")

    proc.sched.add = refuse
    asyncio.run(proc._compile_and_add(ADD))
    finals = [decode(f, channel(TokenBatch)).finals for f in proc.sent]
    assert finals == [{"r1": "error"}] and not proc.sched.pool


def test_a_step_that_fails_after_a_grammar_compiles_ends_the_process(proc):
    def fail(now, results=()):
        raise RuntimeError("injected")

    proc.sched.step = fail

    async def scenario() -> int:
        proc.failed = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(serve([proc._watch(), asyncio.sleep(60)], setup_logging("test", proc.cfg.log)))
        task = asyncio.create_task(proc._compile_and_add(ADD))
        task.add_done_callback(proc._compiled)
        return await asyncio.wait_for(serving, 60)

    assert asyncio.run(scenario()) == 1   # exit status 1: the launcher restarts it, the broker sends the finals
