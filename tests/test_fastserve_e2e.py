"""FastServe on the real embedded model: a device KV pool too small for the started jobs forces
offloads and uploads, and every request's greedy tokens must still equal the ORCA policy's,
offline (inline copies or the swap thread) and served by a two-stage pipeline. Also the stage
side on its own: the KV swap thread against inline copies on a real KV pool."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from serving_harness import start_server

from orca_mq import LLM, SamplingParams
from orca_mq.client import AsyncClient
from orca_mq.sched.fastserve import FastServeScheduler
from orca_mq.protocol.iteration import IterationPlan, SeqWork
from orca_mq.engine.kv_cache import KVCache
from workers.kv_swap import KVSwapper

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    ("In machine learning, overfitting means that a model memorizes its training data instead of learning "
     "patterns that generalize. Common remedies include"),
    "Hello",
    "Translate to French: 'Good morning, how are you?'\nFrench:",
]
MAX_TOKENS = [24, 6, 30, 3, 18, 40, 9]
DEVICE_SLOTS = 8 * 16   # 8 blocks: the jobs started together need about 16


@pytest.fixture(scope="module")
def fastserve_llm():
    return LLM(scheduler__policy="fastserve", dtype="float32", max_bs=2, n_slots=DEVICE_SLOTS, host_slots=64 * 16,
               min_free_blocks=2, starve_limit=0.5)   # its probes run in the constructor


@pytest.fixture(scope="module")
def orca_tokens(embedded_llm):
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    return [o.token_ids for o in embedded_llm.generate(PROMPTS, params)]


def _generate(llm: LLM, kv_policy: str) -> tuple[list[list[int]], list[dict], FastServeScheduler]:
    llm.cfg.fastserve.kv_policy = kv_policy
    sched = llm.scheduler = FastServeScheduler(llm.cfg, llm.info, llm.scheduler.profile)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    return [o.token_ids for o in outs], [sched.request_metrics(o.request_id) for o in outs], sched


@pytest.mark.e2e
@pytest.mark.parametrize("kv_policy,swap_thread", [("proactive", False), ("proactive", True), ("reactive", False)])
def test_fastserve_matches_orca_with_kv_offload(fastserve_llm, orca_tokens, kv_policy, swap_thread):
    llm = fastserve_llm
    llm.runner.swapper = KVSwapper(llm.runner.kv, llm.runner.host_blocks) if swap_thread else None
    try:
        tokens, metrics, sched = _generate(llm, kv_policy)
    finally:
        if llm.runner.swapper is not None:
            llm.runner.swapper.close()
        llm.runner.swapper = None
    assert tokens == orca_tokens
    offloads, uploads = sum(m["offloads"] for m in metrics), sum(m["uploads"] for m in metrics)
    assert offloads > 0 and uploads == offloads   # every offloaded job came back to finish
    assert sum(m["upload_bytes"] for m in metrics) == sum(m["offload_bytes"] for m in metrics) > 0
    assert any(m["demotions"] for m in metrics)
    stats = sched.stats()
    assert stats["free_slots"] == stats["n_slots"] and stats["host_free_slots"] == stats["host_slots"]
    assert stats["on_host"] == 0 and not sched.block_manager.tables and not sched.host_block_manager.tables


@pytest.mark.e2e
def test_served_fastserve_pipeline_matches_orca(tmp_path, orca_tokens):
    """Through tools/launch.py with two pipeline stages: every stage applies the plans' swaps."""
    srv = start_server(tmp_path, n_workers=2, **{"scheduler.policy": "fastserve", "scheduler.max_bs": 2,
                                                 "engine.n_slots": DEVICE_SLOTS, "engine.host_slots": 64 * 16,
                                                 "fastserve.min_free_blocks": 2})

    async def run():
        async with AsyncClient(srv.address) as client:
            outs = await asyncio.gather(*(client.generate(prompt=p, max_tokens=m, temperature=0.0, ignore_eos=True)
                                          for p, m in zip(PROMPTS, MAX_TOKENS)))
            return outs, await client.stats()

    try:
        outs, stats = asyncio.run(run())
    finally:
        assert srv.stop() == 0, srv.stderr()[-3000:]
    assert [o.token_ids for o in outs] == orca_tokens
    assert all(o.metrics["scheduler"]["queue_history"] for o in outs)  # FastServe metrics in the final message
    assert sum(o.metrics["scheduler"]["offloads"] for o in outs) > 0
    sched = stats["scheduler"]
    assert sched["free_slots"] == sched["n_slots"] and sched["host_free_slots"] == sched["host_slots"]
    lines = [json.loads(line) for line in (srv.log_dir / "scheduler.log").read_text().splitlines()]
    done = [rec for rec in lines if rec.get("event") == "fastserve request done"]
    assert len(done) >= len(PROMPTS) and sum(rec["offloads"] for rec in done) > 0


def test_swap_thread_matches_inline_copies(monkeypatch):
    """Plans arrive (submit) ahead of compute; each compute (wait) must see its blocks exactly as
    inline copies would leave them, while uploads for later plans may still be in flight. Slow
    copies make a compute that does not wait read stale blocks."""
    copy = KVCache.copy_blocks

    def slow_copy(self: KVCache, dst: KVCache, pairs: list[tuple[int, int]]) -> None:
        time.sleep(0.02)
        copy(self, dst, pairs)

    monkeypatch.setattr(KVCache, "copy_blocks", slow_copy)
    torch.manual_seed(0)
    kv = KVCache.allocate(3, 12, 4, 2, 8, torch.float32, torch.device("cpu"))
    kv.k.normal_()
    kv.v.normal_()
    ref = KVCache(kv.k.clone(), kv.v.clone())
    ref_host = ref.host_pool(10)
    swapper = KVSwapper(kv, 10)

    def plan(i: int, blocks: list[int], out: list[tuple[int, int]], into: list[tuple[int, int]]) -> IterationPlan:
        return IterationPlan(i, [SeqWork("r", [1], 0, blocks)], swap_out=out, swap_in=into)

    plans = [
        plan(1, [0], [(1, 0), (2, 1)], []),          # offload two blocks
        plan(2, [1, 2], [(3, 2)], [(0, 1), (1, 2)]),   # upload them into the freed blocks the plan reads
        plan(3, [3], [(4, 3)], [(2, 5)]),            # proactive offload and prefetch, for later plans
        plan(4, [5, 4], [], []),                     # no copies of its own: waits for plan 3's
    ]
    for p in plans:
        swapper.submit(p)
    for p in plans:
        swapper.wait(p)
        ref.copy_blocks(ref_host, p.swap_out)
        ref_host.copy_blocks(ref, p.swap_in)
        for b in p.seqs[0].block_table:
            assert torch.equal(kv.k[:, b], ref.k[:, b]) and torch.equal(kv.v[:, b], ref.v[:, b])
    swapper.close()
