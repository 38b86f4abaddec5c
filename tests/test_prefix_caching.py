"""Prefix caching on the real embedded model (fp32, greedy): outputs equal those computed with
caching off, offline and served by two pipeline stages, while repeated prefixes skip their
prefill (cached_tokens). Covers a prompt that is an exact multiple of the block size (its last
token is still computed), an exact repeat, and requests that share a prefix still being prefilled
in chunks (they take its blocks as they are published)."""
from __future__ import annotations

import asyncio

import pytest
from serving_harness import settled, start_server

from orca_mq import LLM, SamplingParams
from orca_mq.client import AsyncClient

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, cite the rule you apply, and say "
          "when you do not know. Rules: be polite; use metric units; never invent sources; keep lists short. "
          "When a question is ambiguous, state the reading you chose before you answer it.")
QUESTIONS = [" Q: What is the boiling point of water? A:", " Q: Name three prime numbers. A:"]
BS = 16
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def prompts(embedded_llm) -> list[list[int]]:
    tok = embedded_llm.generate([SYSTEM + q for q in QUESTIONS], SamplingParams(max_tokens=1))
    a, b = (o.prompt_token_ids for o in tok)
    assert len(a) > 3 * BS and a[:3 * BS] == b[:3 * BS]
    return [a[:3 * BS], a, b, a]   # a whole-blocks prompt, two sharing its blocks, an exact repeat


@pytest.fixture(scope="module")
def uncached(prompts) -> list[list[int]]:
    llm = LLM(max_bs=4, n_slots=4096, dtype="float32", prefix_caching=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(llm.scheduler.request_metrics(o.request_id)["cached_tokens"] == 0 for o in outs)
    return [o.token_ids for o in outs]


@pytest.mark.e2e
def test_offline_cached_prefill_is_exact(prompts, uncached):
    # a token budget of 2 blocks: prompts are prefilled in chunks, the others start meanwhile
    llm = LLM(max_bs=4, n_slots=4096, dtype="float32", max_num_batched_tokens=2 * BS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params)
    cached = [llm.scheduler.request_metrics(o.request_id)["cached_tokens"] for o in first]
    assert [o.token_ids for o in first] == uncached
    assert sum(cached[1:]) >= 2 * BS   # the later ones took blocks the first published mid-prefill
    again = llm.generate(prompts, params)   # all cached now, up to the block holding the last prompt token
    assert [o.token_ids for o in again] == uncached
    assert [llm.scheduler.request_metrics(o.request_id)["cached_tokens"] for o in again] == \
        [(len(p) - 1) // BS * BS for p in prompts]
    stats = llm.scheduler.stats()
    assert stats["used_slots"] == 0 and stats["prefix_cache_hits"] > 0 and stats["prefix_cache_slots"] > 0


@pytest.mark.e2e
def test_served_pipeline_reuses_prefix_and_matches_uncached(tmp_path, prompts, uncached):
    srv = start_server(tmp_path, n_workers=2, **{"scheduler.max_bs": 4, "scheduler.max_num_batched_tokens": 2 * BS})

    async def run():
        async with AsyncClient(srv.address) as client:
            gen = [dict(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for p in prompts]
            first = await client.generate(**gen[1])                     # computes the shared blocks
            rest = await asyncio.gather(*(client.generate(**g) for g in gen))
            return [first, *rest]

    try:
        outs = asyncio.run(run())
        stats = settled(srv.address)
    finally:
        assert srv.stop() == 0, srv.stderr()[-3000:]
    assert [o.token_ids for o in outs] == [uncached[1], *uncached]
    cached = [o.metrics["scheduler"]["cached_tokens"] for o in outs]
    assert cached[0] == 0 and cached[2] == cached[4] == (len(prompts[1]) - 1) // BS * BS and cached[3] >= 3 * BS
    assert stats["scheduler"]["prefix_cache_hits"] >= sum(cached) and stats["scheduler"]["used_slots"] == 0
