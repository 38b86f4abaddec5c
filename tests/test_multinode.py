"""Many hosts, on one machine: two launcher invocations act as two nodes over loopback TCP.

One stage with tp_size 2 over two nodes: node 0 runs the broker, frontend, scheduler and TP rank 0;
node 1 runs TP rank 1, reaching node 0's broker and rendezvous over TCP, taking its control frames
over TCP from rank 0 and all-reducing with it over gloo on TCP. Checked: greedy
tokens equal transformers'; a node killed mid-run gives every in-flight request an error final and
stops node 0 (exit 1); a node that never joins (or a node 0 that never comes up) is a clear error.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from orca_mq.client import AsyncClient, Client
from orca_mq.runtime.placement import placement
from orca_mq.server.nodes import STOPPED, NodeGroup
from serving_harness import ROOT, Server, alive, children_of, free_port, start_server

pytestmark = pytest.mark.e2e
PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
MAX_TOKENS = 8


def _launch(sets: dict[str, object], stderr: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(ROOT / "tools" / "launch.py")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True)


@dataclass
class TwoNodes:
    node0: Server
    node1: subprocess.Popen[str]
    node1_workers: dict[int, str]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_nodes")
    shared = {"server.worker_base_port": free_port(), "server.backend_address": f"tcp://127.0.0.1:{free_port()}",
              "server.nnodes": 2, "server.node_timeout": 3.0, "engine.tp_size": 2,
              "engine.threads_per_worker": 1, "engine.n_slots": 4096, "model.dtype": "float32"}
    # node 1 first: it waits for node 0's rendezvous, as a host started early would
    node1 = _launch({**shared, "server.node_rank": 1, "log.dir": str(tmp / "node1_logs")}, tmp / "node1.stderr")
    try:
        node0 = start_server(tmp / "node0", n_workers=1, **shared)
    except BaseException:
        node1.kill()
        raise
    # node 1's launcher prints its line once its workers are spawned, before node 0 is ready
    assert node1.stdout is not None and "joined" in node1.stdout.readline()
    yield TwoNodes(node0, node1, children_of(node1.pid))
    node0.stop()
    for pid in children_of(node1.pid):
        os.kill(pid, signal.SIGKILL)
    node1.kill()
    node1.wait()


def test_two_nodes_serve_greedy_like_transformers(two_nodes, hf_reference):
    from orca_mq.tokenizer import load_tokenizer

    assert any("--tp-rank 1" in cmd for cmd in two_nodes.node1_workers.values())
    assert not any("--tp-rank 1" in cmd for cmd in two_nodes.node0.children.values())
    tok = load_tokenizer()
    with Client(two_nodes.node0.address) as client:
        for prompt in PROMPTS:
            out = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
            ids = torch.tensor([tok.encode(prompt)])
            ref = hf_reference.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
            assert out.finish_reason == "length" and out.token_ids == ref[0, ids.shape[1]:].tolist()


def test_node_killed_mid_run_errors_every_request(two_nodes):
    node0 = two_nodes.node0

    async def run() -> tuple[list[str | None], float]:
        async with AsyncClient(node0.address) as client:
            async def one(i: int, first: asyncio.Event) -> str | None:
                async for ev in client.stream(f"Count slowly to a thousand, attempt {i}:", max_tokens=400,
                                              temperature=0.0):
                    first.set()
                    if ev.finish_reason:
                        return ev.finish_reason
                return None

            started = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(one(i, e)) for i, e in enumerate(started)]
            await asyncio.gather(*(e.wait() for e in started))
            for pid in two_nodes.node1_workers:  # the host goes down: its workers, then its launcher
                os.kill(pid, signal.SIGKILL)
            os.kill(two_nodes.node1.pid, signal.SIGKILL)
            killed = time.monotonic()
            finals = await asyncio.gather(*tasks)
            return finals, time.monotonic() - killed

    finals, took = asyncio.run(asyncio.wait_for(run(), 120))
    assert finals == ["error"] * 4, finals
    assert took < 30, f"the errors came {took:.1f} s after the kill"
    assert node0.proc.wait(30) == 1
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in node0.children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [cmd for pid, cmd in node0.children.items() if alive(pid)]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_missing_node_is_a_clear_error(rank, tmp_path):
    """Node 0 alone waits ready_timeout for node 1; node 1 alone cannot reach node 0's rendezvous."""
    sets = {"server.worker_base_port": free_port(), "server.backend_address": f"tcp://127.0.0.1:{free_port()}",
            "server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "server.nnodes": 2,
            "server.node_rank": rank, "server.ready_timeout": 4.0, "log.dir": str(tmp_path / "logs")}
    proc = _launch(sets, tmp_path / "stderr")
    try:
        assert proc.wait(90) == 1
    finally:
        proc.kill()
    expected = "node(s) [1] did not join within server.ready_timeout=4s" if rank == 0 else "cannot reach node 0's rendezvous"
    assert expected in (tmp_path / "stderr").read_text()


def test_placement_keeps_stages_whole_where_they_fit():
    assert placement(4, 2, 2) == [0, 0, 0, 0, 1, 1, 1, 1]      # 2 stages x TP 2 per node
    assert placement(3, 1, 2) == [0, 0, 1]
    assert placement(1, 4, 2) == [0, 0, 1, 1]                   # fewer stages than nodes: the TP group spans them
    with pytest.raises(ValueError, match="cannot fill"):
        placement(1, 1, 2)


def test_heartbeats_and_failure_reports(tmp_path):
    """Node 0 declares a node dead when its heartbeat stalls for node_timeout, or when it reports a failure."""
    from orca_mq.config import load_config

    def cfg(rank: int):
        return load_config(overrides={"server.nnodes": 3, "server.node_rank": rank, "server.node_timeout": 2.0,
                                      "server.worker_base_port": port, "server.ready_timeout": 10.0})

    port = free_port()
    node0 = NodeGroup.open(cfg(0))
    others = [NodeGroup.open(cfg(r)) for r in (1, 2)]
    for n in others:
        n.store.set(f"launch/node{n.rank}", "test")
    node0.join(_NullLog())
    others[1].report("worker2 (pid 1, exit 1) died")
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:  # node 1 keeps beating, node 2 has reported its failure
        assert others[0].poll() == []
        assert node0.poll() == ["node 2 (worker2 (pid 1, exit 1) died)"]
        time.sleep(0.1)
    time.sleep(2.5)  # node 1 stops beating
    dead = node0.poll()
    assert len(dead) == 2 and dead[0].startswith("node 1 (no heartbeat for ") and dead[1].startswith("node 2 (worker2")
    node0.report(STOPPED)
    assert others[0].poll() == [STOPPED]


class _NullLog:
    def info(self, *args: object, **kwargs: object) -> None:
        pass
