"""Tensor parallelism is exact: TP ranks (and TP x PP grids) of real worker processes over gloo give the
single-process engine's logits, and on the embedded model transformers' greedy tokens."""
from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from orca_mq.config import Config, load_config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.engine.parallel import shard_spec
from orca_mq.models.registry import read_model_info
from orca_mq.protocol.iteration import IterationPlan, SeqWork
from orca_mq.kv.block_manager import BlockManager
from orca_mq.kv.pool import PoolSize
from workers.local_grid import Step, run_grid


def _cfg(model: str, block_size: int = 8, n_slots: int = 2048) -> Config:
    return load_config(overrides={"model.path": model, "engine.block_size": block_size, "engine.n_slots": n_slots,
                                  "engine.threads_per_worker": 1, "engine.attention_backend": "torch",
                                  "model.dtype": "float32"})


def _mixed_plans(vocab: int, num_blocks: int, block_size: int, seed: int) -> tuple[list[IterationPlan], list[str]]:
    """A warm-up iteration filling the decode requests' KV, then ONE iteration mixing whole prefills
    with each decode request's next token, block tables scattered over the pool."""
    rng = random.Random(seed)
    prefills = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 33)]
    decodes = [[rng.randrange(vocab) for _ in range(n)] for n in (2, 9, 17, 40)]
    bm = BlockManager(PoolSize(block_size, num_blocks, 0))
    rng.shuffle(bm.device.free)
    warm = [SeqWork(f"d{i}", s[:-1], 0, list(bm.ensure(f"d{i}", len(s)))) for i, s in enumerate(decodes)]
    mixed = [SeqWork(f"d{i}", [s[-1]], len(s) - 1, list(bm.table(f"d{i}"))) for i, s in enumerate(decodes)]
    mixed += [SeqWork(f"p{i}", s, 0, list(bm.ensure(f"p{i}", len(s)))) for i, s in enumerate(prefills)]
    rng.shuffle(mixed)
    return [IterationPlan(0, warm), IterationPlan(1, mixed)], [s.request_id for s in mixed]


def _logits_job(step: Step, runner: ModelRunner, plans: list[IterationPlan]) -> Any:
    return [step(p) for p in plans][-1].numpy()


def _greedy_job(step: Step, runner: ModelRunner, job: tuple[list[list[int]], int]) -> Any:
    """Greedy decoding of every prompt together for `steps` tokens (one stage: it holds the logits)."""
    prompts, steps = job
    bm = BlockManager(runner.pool)
    tables = [list(bm.ensure(str(i), len(p) + steps)) for i, p in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    plan = IterationPlan(0, [SeqWork(str(i), p, 0, tables[i]) for i, p in enumerate(prompts)])
    for it in range(steps):
        for out, t in zip(tokens, step(plan).argmax(-1).tolist()):
            out.append(t)
        plan = IterationPlan(it + 1, [SeqWork(str(i), [tokens[i][-1]], len(p) + it, tables[i])
                                      for i, p in enumerate(prompts)])
    return tokens


@pytest.mark.parametrize("arch,n_stages,tp", [("llama", 1, 2), ("gpt2", 1, 2), ("llama", 2, 2)])
def test_tp_logits_match_single_process(arch, n_stages, tp, tiny_llama_dir, tiny_gpt2_dir):
    cfg = _cfg(str(tiny_llama_dir if arch == "llama" else tiny_gpt2_dir))
    single = ModelRunner(cfg)
    plans, order = _mixed_plans(single.info.vocab_size, single.kv.num_blocks, single.block_size, seed=5)
    expected = [single.forward(p) for p in plans][-1]
    got = torch.from_numpy(run_grid(n_stages, tp, cfg, _logits_job, plans))
    assert got.shape == expected.shape == (len(order), single.info.vocab_size)
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("heads,kv,size", [(9, 3, 2), (4, 2, 4), (8, 8, 3), (12, 4, 8)])
def test_shard_specs_cover_every_head_once(heads, kv, size, tiny_llama_dir):
    """Query heads are partitioned; each rank's KV heads are exactly those its query heads read."""
    from dataclasses import replace

    info = replace(read_model_info(str(tiny_llama_dir)), n_heads=heads, n_kv_heads=kv, hidden_size=heads * 16)
    specs = [shard_spec(info, r, size) for r in range(size)]
    assert sorted(h for s in specs for h in s.heads) == list(range(heads))
    for s in specs:
        assert s.heads and {h // (heads // kv) for h in s.heads} == set(s.kv_heads)
    assert sorted(c for s in specs for c in s.ffn) == list(range(info.intermediate_size))
    with pytest.raises(ValueError, match="multiple"):
        shard_spec(replace(info, n_heads=4, n_kv_heads=2), 0, 3)


def test_replicated_kv_heads_match(tiny_llama_dir):
    """4 ranks over the tiny Llama's 2 KV heads: each KV head lives on two ranks that split its queries."""
    cfg = _cfg(str(tiny_llama_dir))
    info = read_model_info(str(tiny_llama_dir))
    specs = [shard_spec(info, r, 4) for r in range(4)]
    assert [list(s.kv_heads) for s in specs] == [[0], [0], [1], [1]] and [list(s.heads) for s in specs] == [[0], [1], [2], [3]]
    single = ModelRunner(cfg)
    plans, _ = _mixed_plans(info.vocab_size, single.kv.num_blocks, single.block_size, seed=9)
    expected = [single.forward(p) for p in plans][-1]
    assert (torch.from_numpy(run_grid(1, 4, cfg, _logits_job, plans)) - expected).abs().max().item() <= 1e-4


@pytest.mark.e2e
def test_tp2_greedy_matches_transformers_on_embedded_model(hf_reference):
    """SmolLM2-135M: 9 query heads and 3 KV heads over 2 ranks (6 + 3 and 2 + 1), vocab 49152 split in two."""
    from orca_mq.tokenizer import load_tokenizer

    tok = load_tokenizer()
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,")]
    steps = 12
    got = run_grid(1, 2, load_config(overrides={"engine.threads_per_worker": 1, "model.dtype": "float32"}), _greedy_job, (prompts, steps))
    for ids, ours in zip(prompts, got):
        ref = hf_reference.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        assert ours == ref[0, len(ids):].tolist()
