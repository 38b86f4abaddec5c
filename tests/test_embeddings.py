"""Embeddings offline (LLM.embed) against transformers' own hidden states, and embedding requests inside
iteration-level batching (issue 41, item 5): tiny random checkpoints of two families (qwen3, gemma2:
its embedding scale and soft-caps), prompts longer than the token budget (chunked), last and mean
pooling, normalised or not, the prefix cache on; beside generating requests under every policy, whose
greedy tokens stay those they get alone; every request ends with one final and its KV freed. And the
plan's pooling columns and protocol 10 on the wire."""
from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from orca_mq import LLM, SamplingParams
from orca_mq.protocol import ProtocolError, decode, encode, unpack
from orca_mq.protocol.client_msgs import TO_CLIENT, TO_SERVER, Final, Generate, Outputs
from orca_mq.protocol.iteration import IterationPlan, SeqWork, pack

from conftest import EMBEDDING_FAMILIES as FAMILIES

BUDGET = 16                      # tokens an iteration: the longer prompts go in chunks
PROMPTS = (40, 7, 23, 1)
COSINE = 0.9999                  # fp32: sums over a few hundred terms, far above their rounding
NORM_TOL = 1e-4                  # an unnormalised vector's length, relative


def _llm(path: Path, **more: object) -> LLM:
    return LLM(model=str(path), **{"max_bs": 3, "n_slots": 1024, "block_size": 8, "dtype": "float32", "max_model_len": 256,
                                   "max_num_batched_tokens": BUDGET, "profile_max_len": 32, "progress": False} | more)


def _prompts(seed: int, lengths: tuple[int, ...] = PROMPTS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


@torch.no_grad()
def _expected(ref: torch.nn.Module, prompt: list[int], pooling: str) -> torch.Tensor:
    hidden = ref(torch.tensor([prompt])).last_hidden_state[0]
    return hidden[-1] if pooling == "last" else hidden.mean(0)


def _check(vector: list[float], expected: torch.Tensor, normalized: bool) -> None:
    v = torch.tensor(vector)
    assert len(v) == len(expected)
    assert torch.nn.functional.cosine_similarity(v, expected, 0).item() >= COSINE
    length = 1.0 if normalized else expected.norm().item()
    assert abs(v.norm().item() - length) <= NORM_TOL * length


@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_equal_transformers(family, embedding_checkpoints, embedding_references):
    """Last and mean pooling, normalised or not, the longer prompts chunked: transformers' last_hidden_state
    pooled the same way. Asked again, a last-token embedding takes its prompt's blocks from the prefix cache
    (same vector), a mean one computes every token. CUDA graphs on (the CPU runs the same buckets): an
    iteration that pools runs eagerly."""
    llm = _llm(embedding_checkpoints[family], cuda_graphs="on")
    prompts = _prompts(3)
    for pooling, normalize in (("last", True), ("mean", False)):
        outs = llm.embed(prompts, pooling=pooling, normalize=normalize)
        for prompt, out in zip(prompts, outs):
            assert out.finish_reason == "stop" and out.prompt_tokens == len(prompt)
            _check(out.embedding, _expected(embedding_references[family], prompt, pooling), normalize)
        again = llm.embed(prompts[0], pooling=pooling)[0]
        cached = again.metrics["scheduler"]["cached_tokens"]
        assert (cached > 0) if pooling == "last" else (cached == 0)
        _check(again.embedding, _expected(embedding_references[family], prompts[0], pooling), True)
    assert llm.scheduler.block_manager.num_used_slots == 0


def _finals(llm: LLM) -> Counter[str]:
    """Counts the final events the scheduler emits from now on, by request."""
    finals: Counter[str] = Counter()
    step = llm.scheduler.step

    def counting(now, results=()):   # type: ignore[no-untyped-def]
        out = step(now, results)
        finals.update(e.request_id for e in out.events if e.finish_reason)
        return out

    llm.scheduler.step = counting   # type: ignore[method-assign]
    return finals


GEN_PROMPTS, EMBED_PROMPTS = _prompts(5, (20, 5)), _prompts(6, (24, 7, 13))   # embeddings: 44 tokens, not whole budgets
GEN_PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 4)]


@pytest.fixture(scope="module")
def alone(embedding_checkpoints) -> list[list[int]]:
    """The generations' greedy tokens when they run alone."""
    return [o.token_ids for o in _llm(embedding_checkpoints["qwen3"]).generate(GEN_PROMPTS, GEN_PARAMS)]


@pytest.mark.parametrize("policy", ["orca", "orca-async", "request", "srpt", "fastserve"])
def test_embeddings_beside_generation(policy, alone, embedding_checkpoints, embedding_references):
    """Two greedy generations and three embedding requests submitted together share iterations (selective
    batching, chunked prompts) under each policy (max_bs 5, and whatever order a policy picks, an
    iteration's budget holds the end of one kind's prompts and the start of the other's); the generations' tokens are those they get alone, the embeddings transformers', each
    request ends once and the pool is empty after."""
    name, _, mode = policy.partition("-")
    llm = _llm(embedding_checkpoints["qwen3"], policy=name, async_scheduling="on" if mode else "off", max_bs=5)
    finals = _finals(llm)
    gens = [llm.model.admit(f"g{i}", p, sp) for i, (p, sp) in enumerate(zip(GEN_PROMPTS, GEN_PARAMS))]
    embeds = [llm.model.admit_embedding(f"e{i}", p, {"pooling": pooling})
              for i, (p, pooling) in enumerate(zip(EMBED_PROMPTS, ("last", "mean", "last")))]
    for req in gens + embeds:
        llm.scheduler.add(req)
    llm.run_until_done()
    assert [r.output_token_ids for r in gens] == alone
    for req, pooling in zip(embeds, ("last", "mean", "last")):
        assert req.finish_reason == "stop" and not req.output_token_ids
        _check(np.frombuffer(req.embedding, "<f4").tolist(), _expected(embedding_references["qwen3"], req.prompt_token_ids, pooling), True)
    assert finals == Counter({r.request_id: 1 for r in gens + embeds})
    shared = [rids for _, rids in llm.scheduler.record if {"g0", "g1"} & set(rids) and {"e0", "e1", "e2"} & set(rids)]
    assert shared, "no iteration mixed an embedding with a generation"
    bm = llm.scheduler.block_manager
    assert bm.num_used_slots == 0 and bm.n_rsrv == 0 and not llm.scheduler.pool


def test_an_embedding_reserves_its_prompt_only(embedding_checkpoints):
    """A pool that holds a prompt exactly serves its embedding (it generates nothing), refuses a generation of it."""
    llm = LLM(model=str(embedding_checkpoints["qwen3"]), n_slots=40, block_size=8, dtype="float32", max_model_len=256,
              progress=False)
    prompt = _prompts(7)[0]   # 40 tokens: the whole pool
    assert llm.embed(prompt)[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="KV pool"):
        llm.generate(prompt, SamplingParams(max_tokens=1))


def test_plan_pooling_columns():
    """A plan's pooling rows travel as two sparse columns (none at all when no row pools) and are checked."""
    seqs = [SeqWork("a", [5, 6, 7], 0, [0], sample=False, pool=3), SeqWork("b", [8], 4, [1]),
            SeqWork("c", [9, 10], 0, [2], sample=False, pool=1)]
    a = pack(IterationPlan(1, seqs)).arrays()
    assert a.pool_rows.tolist() == [0, 2] and a.pool_counts.tolist() == [3, 1]
    plain = pack(IterationPlan(2, seqs[1:2]))
    assert plain.pool_rows == plain.pool_counts == b"" and plain.arrays().pool_rows is None
    for rows, counts in (([0, 2], [4, 1]), ([2, 0], [1, 3]), ([0], [3, 1]), ([0, 5], [1, 1]), ([0], [0])):
        bad = pack(IterationPlan(3, seqs))
        bad.pool_rows, bad.pool_counts = np.array(rows, "<i4").tobytes(), np.array(counts, "<i4").tobytes()
        with pytest.raises(ValueError, match="pooling"):
            bad.arrays()


def test_protocol_10_embeddings():
    """An older client's frame cannot hold `pooling` (refused, naming the version it needs); a vector travels
    as an optional column of `outputs`, which an older client's frame leaves out."""
    body = unpack(encode(Generate("r", prompt="x", pooling={"pooling": "mean"})))
    assert decode(msgpack.packb(body), TO_SERVER).pooling == {"pooling": "mean"}
    with pytest.raises(ProtocolError, match="'pooling' needs protocol version 10") as e:
        decode(msgpack.packb({**body, "v": 9}), TO_SERVER)
    assert e.value.request_id == "r"
    vector = np.arange(4, dtype="<f4").tobytes()
    out = Outputs(["g", "e"], [[1], []], ["a", ""], [None, Final("stop")], embeddings=[None, vector])
    assert [o.embedding for o in decode(encode(out), TO_CLIENT).rows()] == [None, vector]
    assert "embeddings" not in unpack(encode(out, 9))
