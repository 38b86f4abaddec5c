"""Speculative decoding (n-gram prompt lookup): the proposer, the rollback, the verify row's inputs and
acceptance, and the real engine giving the tokens it gives without speculation (fp32), greedy and
seeded, alone and in busy batches, with prefix caching, deterministic mode and FastServe."""
from __future__ import annotations

import random

import pytest

from orca_mq import LLM, SamplingParams
from orca_mq.api.metrics import EngineCollector
from orca_mq.config import load_config
from orca_mq.engine.model_runner import verify
from orca_mq.engine.step_inputs import Geometry, build
from orca_mq.kv.block_manager import BlockManager
from orca_mq.kv.pool import PoolSize
from orca_mq.protocol.codec import decode, encode
from orca_mq.protocol.engine_msgs import IterationDone
from orca_mq.protocol.iteration import IterationPlan, IterationResult, SeqWork, pack
from orca_mq.protocol.structured import StructuredOutputsParams
from orca_mq.sched.request import Request
from orca_mq.sched.spec_state import NgramIndex
from orca_mq.sched.speculative import Speculator


def test_lookup_takes_the_latest_longest_match_and_copies_a_loop() -> None:
    idx = NgramIndex(1, 3, [5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6])
    assert idx.propose(3) == [8, 2, 9]          # "5 6" last ended at 5 (before the newest 5 6): then 8 2 9
    idx.extend([8])
    assert idx.propose(2) == [2, 9]             # "5 6 8" now matches, longest first
    loop = NgramIndex(2, 2, [4, 1, 2, 1, 2])
    assert loop.propose(5) == [1, 2, 1, 2, 1]   # what followed runs into the newest token: the copy copies itself
    assert NgramIndex(2, 4, [1, 2, 3, 4]).propose(4) == []
    assert NgramIndex(2, 4, [3]).propose(4) == []


def _request(rid: str, prompt: list[int], **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=params.pop("max_tokens", 20), temperature=0, **params))


def test_speculator_room_limits_eligibility_and_back_off() -> None:
    cfg = load_config(overrides={"speculative.method": "ngram", "speculative.num_tokens": 4,
                                 "speculative.max_batch_tokens": 6}).speculative
    spec = Speculator(cfg, token_budget=256)
    loop = [1, 2] * 8
    a, b, c = _request("a", loop), _request("b", loop), _request("c", loop, max_tokens=3)
    grammar = _request("g", loop, structured_outputs=StructuredOutputsParams(regex="[12]+"))
    pen = _request("p", loop, presence_penalty=0.5)
    for r in (a, b, c, grammar, pen):
        spec.start(r)
        r.n_prompt_fed, r.output_token_ids = len(loop), [1, 2]
    grammar.grammar = object()   # type: ignore[assignment]   # compiled: it verifies nothing here
    drafts = spec.propose([a, b, grammar, pen], tokens=4, max_len=100)
    assert drafts == {"a": [1, 2]}                       # 6 - 4 tokens of room, a first; the others never draft
    assert spec.propose([c], tokens=1, max_len=100) == {}   # max_tokens 3: the one token left is its next
    assert spec.propose([a], tokens=1, max_len=19) == {"a": [1]}   # the model's length
    spec.learn(a, 4, 4)
    assert a.spec.k == 4 and a.spec.accepted == 4
    spec.learn(a, 4, 1)
    assert a.spec.k == 2
    spec.learn(a, 2, 0)
    spec.learn(a, 1, 0)                                  # two misses in a row: it waits
    assert a.spec.wait == 2 and spec.propose([a], 1, 100) == {} and spec.propose([a], 1, 100) == {}
    assert spec.propose([a], 1, 100) == {"a": [1]}
    c_stats = spec.counters.stats()
    assert c_stats["spec_drafts"] == 4 and c_stats["spec_draft_tokens"] == 11 and c_stats["spec_accepted_tokens"] == 5
    assert c_stats["spec_accepted_per_pos"] == [2, 1, 1, 1]


def test_trim_returns_the_blocks_only_rejected_drafts_needed() -> None:
    bm = BlockManager(PoolSize(block_size=4, device_blocks=16, host_blocks=0), seed=None, host=False)
    req = _request("r", [1] * 6, max_tokens=20)
    bm.reserve(req, bm.blocks_for(req.max_total_tokens))
    n_rsrv = bm.n_rsrv
    bm.ensure("r", 14)                     # 6 tokens + a draft reaching position 13: 4 blocks
    assert len(bm.table("r")) == 4 and bm.n_rsrv == n_rsrv
    bm.trim("r", 8)                        # 2 kept: 8 tokens need 2 blocks
    assert len(bm.table("r")) == 2 and bm.num_free_blocks == 14 and bm.n_rsrv == n_rsrv
    bm.release(req)
    assert bm.num_free_blocks == 16 and bm.n_rsrv == 0


def _plan() -> IterationPlan:
    return IterationPlan(1, [SeqWork("p", [5, 6, 7], 0, [0]), SeqWork("v", [9, 1, 2, 3], 5, [1, 2, 4], draft=3),
                             SeqWork("d", [4], 2, [3])])


@pytest.mark.parametrize("split", [False, True])
def test_a_verify_row_is_one_token_rows_with_a_logit_each(split: bool) -> None:
    step = build(pack(_plan()).arrays(), Geometry(4, 8, 100, 64, token_rows=False, split_decode=split))
    f = step.fields
    assert f["logit_rows"].tolist() == [2, 3, 4, 5, 6, 7]                   # p's last, v's 4, d's
    if split:   # the decode path: v's tokens an attention row each, over its KV up to itself
        assert f["cu_q_lens"].tolist() == [0, 3, 4, 5, 6, 7, 8] and f["seq_lens"].tolist() == [3, 6, 7, 8, 9, 3]
        assert f["block_tables"][1:5].tolist() == [[1, 2, 4]] * 4
        assert f["decode_tokens"].tolist() == [3, 4, 5, 6, 7] and [p[:2] for p in step.prefills] == [(0, 3)]
    else:       # a chunk (Triton, CUDA graphs' mixed buckets)
        assert f["cu_q_lens"].tolist() == [0, 3, 7, 8] and f["seq_lens"].tolist() == [3, 9, 3]
    assert not step.decode_only


def test_acceptance_keeps_the_agreeing_prefix_and_the_next_token() -> None:
    a = pack(_plan()).arrays()
    sampled = [50, 1, 2, 8, 0, 60]            # logit rows: p | v after 9, 1, 2, 3 | d
    result = IterationResult(1, [50, 1, 60])
    verify(result, a, sampled, a.sampled_positions()[0].tolist())
    assert result.verify_rows == [1] and result.verified == [[2, 8]]   # 1 and 2 agree, 8 replaces the draft's 3
    all_kept = IterationResult(1, [50, 1, 60])
    verify(all_kept, a, [50, 1, 2, 3, 44, 60], a.sampled_positions()[0].tolist())
    assert all_kept.verified == [[2, 3, 44]]                          # every draft, and the bonus token


def test_drafts_and_kept_tokens_cross_the_wire() -> None:
    plan = pack(_plan())
    assert decode(encode(IterationDone(IterationResult(1, [1], verify_rows=[0], verified=[[2, 8]]), 0.0, 1.0)),
                  frozenset({"result"})).result.verified == [[2, 8]]
    assert pack(_plan()).arrays().drafts.tolist() == [0, 3, 0] and plan.drafts
    bad = pack(IterationPlan(1, [SeqWork("v", [9, 1], 5, [1, 2], draft=2)]))
    with pytest.raises(ValueError, match="draft"):
        bad.arrays()


def test_prometheus_names_the_counters() -> None:
    collector = EngineCollector("m", {"scheduler": {"running": 0, "waiting": 0, "used_slots": 0, "n_slots": 1,
                                                    "spec_drafts": 3, "spec_draft_tokens": 9, "spec_accepted_tokens": 5,
                                                    "spec_accepted_per_pos": [3, 2]}})
    samples = {(s.name, s.labels.get("position")): s.value for m in collector.collect() for s in m.samples}
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == 3
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "1")] == 2


# ------------------------------------------------------------ the real engine, fp32


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Token prompts with repeats in them (and a random model loops): something to look up."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(100, 20000) for _ in range(rng.randrange(4, 16))]
        out.append(base * rng.randrange(1, 4) + [rng.randrange(100, 20000) for _ in range(rng.randrange(0, 4))])
    return out


def _run(model: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], alone: bool = False,
         **overrides) -> tuple[list[list[int]], list[str | None], dict]:
    llm = LLM(model, dtype="float32", block_size=4, n_slots=8192, **overrides)
    outs = [llm.generate([p], params)[0] for p in prompts] if alone else llm.generate(prompts, params)
    return [o.token_ids for o in outs], [o.finish_reason for o in outs], llm.scheduler.stats()


@pytest.mark.parametrize("case", ["batch", "alone", "seeded", "prefix", "deterministic", "fastserve"])
def test_outputs_are_the_same_with_speculation(tiny_served_dir, case: str) -> None:
    model = str(tiny_served_dir)
    prompts = _prompts(8)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    params: SamplingParams | list[SamplingParams] = greedy
    over: dict = {}
    if case == "seeded":
        params = [SamplingParams(max_tokens=24, temperature=0.5, top_k=2, seed=i, ignore_eos=True) for i in range(8)]
    if case == "prefix":   # the second half repeats the first: their prompts' blocks come from the cache
        prompts = prompts[:4] * 2
    if case == "deterministic":
        over = {"deterministic": True, "attention_backend": "cpu"}
    if case == "fastserve":
        over = {"policy": "fastserve", "max_bs": 4}
    off, off_reasons, _ = _run(model, prompts, params, alone=case == "alone", **over)
    on, on_reasons, stats = _run(model, prompts, params, alone=case == "alone", speculative__method="ngram", **over)
    assert on == off and on_reasons == off_reasons
    assert stats["spec_accepted_tokens"] > 0 and stats["free_slots"] == stats["n_slots"] - stats["used_slots"]
    assert stats["used_slots"] == stats["prefix_cache_slots"] or stats["used_slots"] == 0


def test_a_stop_inside_a_kept_draft_ends_there(tiny_served_dir) -> None:
    """A stop token or max_tokens met among a verify row's kept tokens ends the request at it, as one
    token at a time would: the tokens after it are dropped, and its blocks come back."""
    model, prompts = str(tiny_served_dir), _prompts(6, seed=1)
    free, _, _ = _run(model, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    stops = [o[len(o) // 2] for o in free]   # a token each output has, past its start
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, stop_token_ids=[s])
              for s, m in zip(stops, (40, 17, 23, 40, 9, 31))]
    off, off_reasons, _ = _run(model, prompts, params, max_num_batched_tokens=0)
    llm = LLM(model, dtype="float32", block_size=4, n_slots=8192, max_num_batched_tokens=0, speculative__method="ngram")
    outs = llm.generate(prompts, params)
    stats = llm.scheduler.stats()
    assert [o.token_ids for o in outs] == off and [o.finish_reason for o in outs] == off_reasons and "stop" in off_reasons
    assert stats["spec_accepted_tokens"] > 0 and stats["free_slots"] == stats["n_slots"] - stats["used_slots"]
    for o in outs:   # a draft token counts as accepted only where it was output: a token a step and those beyond it
        m = o.metrics["scheduler"]
        assert len(o.token_ids) == m["iterations"] + m["spec_accepted_tokens"]


def test_final_metrics_and_stats_count_drafts(tiny_served_dir) -> None:
    """Each offline output's metrics count its drafts (issue 43: they were None), and they add up to the stats."""
    llm = LLM(str(tiny_served_dir), dtype="float32", speculative__method="ngram")
    outs = llm.generate(_prompts(3), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    stats = llm.scheduler.stats()
    per_request = [o.metrics["scheduler"] for o in outs]
    assert sum(m["spec_accepted_tokens"] for m in per_request) == stats["spec_accepted_tokens"] > 0
    assert sum(m["spec_draft_tokens"] for m in per_request) == stats["spec_draft_tokens"]
    assert sum(stats["spec_accepted_per_pos"]) == stats["spec_accepted_tokens"]


@pytest.mark.parametrize("constraint", [{"regex": "(ab|cd|[0-9]{1,3}, )+"},
                                        {"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 40}}])
def test_constrained_drafts_follow_the_grammar(tiny_served_dir, constraint: dict) -> None:
    """A constrained request's draft is cut where its grammar refuses a token, and each position it
    verifies is masked as its grammar will stand there: the tokens are those decoded one at a time."""
    model, prompts = str(tiny_served_dir), _prompts(4, seed=2)
    params = SamplingParams(max_tokens=24, temperature=0, structured_outputs=StructuredOutputsParams(**constraint))
    off, off_reasons, _ = _run(model, prompts, params)
    on, on_reasons, stats = _run(model, prompts, params, speculative__method="ngram")
    assert on == off and on_reasons == off_reasons
    assert stats["spec_accepted_tokens"] > 0 and stats["free_slots"] == stats["n_slots"] - stats["used_slots"]


def test_async_scheduling_still_speculates(tiny_served_dir) -> None:
    """Under async scheduling every running request was planned ahead of its last token, so none was ever
    idle when drafts were proposed: no draft at all (64 iterations for 8 x 64 tokens, against 25 without
    async). A request likely to draft now waits for its token instead: the same tokens, in far fewer
    iterations than one a token."""
    model, prompts = str(tiny_served_dir), _prompts(8)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    sync, _, _ = _run(model, prompts, params, speculative__method="ngram")
    llm = LLM(model, dtype="float32", block_size=4, n_slots=8192, speculative__method="ngram", async_scheduling="on")
    outs = llm.generate(prompts, params)
    stats = llm.scheduler.stats()
    assert llm.scheduler.ahead and [o.token_ids for o in outs] == sync
    assert stats["spec_accepted_tokens"] > 64 and stats["iterations"] < 0.75 * 64, stats
    # a full batch leaves drafts no room (the cap is its rows): requests held back for a draft would wait for
    # none, each every other iteration (68 iterations against 64 without speculation); now planned ahead
    crowded = LLM(model, dtype="float32", block_size=4, n_slots=8192, max_bs=8, speculative__method="ngram",
                  speculative__max_batch_tokens=8, async_scheduling="on")
    assert [o.token_ids for o in crowded.generate(prompts, params)] == sync
    assert crowded.scheduler.stats()["iterations"] <= 64
