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
from orca_mq.protocol.iteration import IterationPlan, PackedPlan, SeqWork, pack
from orca_mq.kv.cache import HostKV, KVCache
from orca_mq.kv.swapper import KVSwapper

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
    llm.cfg.fastserve.preempt_margin = 0.0   # every arrival may take an idle job's room: offloads happen
    sched = llm.scheduler = FastServeScheduler(llm.cfg, llm.info, llm.scheduler.profile)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    return [o.token_ids for o in outs], [o.metrics["scheduler"] for o in outs], sched


@pytest.mark.e2e
@pytest.mark.parametrize("kv_policy,swap_thread", [("proactive", False), ("proactive", True), ("reactive", False)])
def test_fastserve_matches_orca_with_kv_offload(fastserve_llm, orca_tokens, kv_policy, swap_thread):
    llm = fastserve_llm
    llm.runner.swapper = None
    if swap_thread:
        llm.runner.start_swap_thread()
    try:
        tokens, metrics, sched = _generate(llm, kv_policy)
    finally:
        if llm.runner.swapper is not None:
            llm.runner.swapper.close()
        llm.runner.swapper = None
    assert tokens == orca_tokens
    offloads, uploads = sum(m["offloads"] for m in metrics), sum(m["uploads"] for m in metrics)
    assert offloads > 0 and uploads == offloads   # every offloaded job came back to finish
    # an upload copies what the device no longer caches: blocks of its prefix still cached there are taken back by reference
    assert 0 < sum(m["upload_bytes"] for m in metrics) <= sum(m["offload_bytes"] for m in metrics)
    assert any(m["demotions"] for m in metrics)
    stats = sched.stats()
    assert stats["free_slots"] == stats["n_slots"] and stats["host_free_slots"] == stats["host_slots"]
    bm = sched.block_manager
    assert stats["on_host"] == 0 and not bm.device.tables and not bm.host.tables


@pytest.mark.e2e
def test_served_fastserve_pipeline_matches_orca(tmp_path, orca_tokens):
    """Through tools/launch.py with two pipeline stages: every stage applies the plans' swaps."""
    srv = start_server(tmp_path, n_workers=2, **{"scheduler.policy": "fastserve", "scheduler.max_bs": 2,
                                                 "engine.n_slots": DEVICE_SLOTS, "engine.host_slots": 64 * 16,
                                                 "fastserve.min_free_blocks": 2, "fastserve.preempt_margin": 0.0})

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
    for name in ("offload", "upload"):
        fast = getattr(HostKV, name)

        def slow(self: HostKV, kv: KVCache, pairs: list[tuple[int, int]], fast=fast) -> None:
            time.sleep(0.02)
            fast(self, kv, pairs)

        monkeypatch.setattr(HostKV, name, slow)
    torch.manual_seed(0)
    kv = KVCache.allocate(3, 12, 4, 2, 8, torch.float32, torch.device("cpu"))
    kv.k.normal_()
    kv.v.normal_()
    ref = KVCache(kv.k.clone(), kv.v.clone())
    inline = KVSwapper(ref, 10, depth=1, threaded=False)
    swapper = KVSwapper(kv, 10, depth=1)

    def plan(i: int, blocks: list[int], out: list[tuple[int, int]], into: list[tuple[int, int]]) -> PackedPlan:
        return pack(IterationPlan(i, [SeqWork("r", [1], 0, blocks)], swap_out=out, swap_in=into))

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
        inline.wait(p)
        for b in p.block_ids():
            assert torch.equal(kv.k[:, b], ref.k[:, b]) and torch.equal(kv.v[:, b], ref.v[:, b])
        swapper.computed(p)
    swapper.close()


def test_copies_wait_for_the_compute_that_wrote_their_blocks():
    """With one plan in flight at most (depth 1), plan 2 was made after plan 1 came back, so its
    offload must copy what plan 1's compute wrote: the copy thread waits for that compute, however
    early plan 2's frame arrives."""
    kv = KVCache.allocate(2, 4, 4, 1, 8, torch.float32, torch.device("cpu"))
    swapper = KVSwapper(kv, 4, depth=1)
    p1 = pack(IterationPlan(1, [SeqWork("a", [1], 0, [1])]))
    p2 = pack(IterationPlan(2, [SeqWork("b", [1], 0, [2])], swap_out=[(1, 3)]))
    swapper.submit(p1)
    swapper.submit(p2)              # its copies are queued while plan 1 has not computed yet
    swapper.wait(p1)
    time.sleep(0.1)
    kv.k[:, 1] = 7.0                # plan 1's compute writes block 1...
    kv.v[:, 1] = 7.0
    swapper.computed(p1)            # ...and is done
    swapper.wait(p2)
    swapper.computed(p2)
    swapper.wait(pack(IterationPlan(3, [])))   # a plan without copies waits for all earlier ones
    assert (swapper.host.k[3] == 7.0).all() and (swapper.host.v[3] == 7.0).all()
    swapper.close()
