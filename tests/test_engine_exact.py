"""Selective batching is exact: a mixed iteration gives every request the logits it gets alone in transformers."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from orca_mq.bench.plans import mixed_iteration_logits
from orca_mq.kv.block_manager import BlockManager
from orca_mq.config import load_config
from orca_mq.protocol.iteration import IterationPlan, SeqWork
from orca_mq.engine.model_runner import ModelRunner


def _runner(model_dir, block_size: int = 8, n_slots: int = 2048, backend: str = "auto",
            dtype: str = "float32") -> ModelRunner:
    cfg = load_config(overrides={"model.path": str(model_dir), "engine.block_size": block_size,
                                 "engine.n_slots": n_slots, "engine.threads_per_worker": 1,
                                 "engine.attention_backend": backend, "model.dtype": dtype})
    return ModelRunner(cfg)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_mixed_batch_matches_transformers(arch, backend, tiny_llama_dir, tiny_gpt2_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_gpt2_dir
    rng = random.Random(1234)
    runner = _runner(model_dir, backend=backend)
    assert runner.model.attention_backend == backend
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = runner.info.vocab_size
    prefills = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 33, 70)]
    decodes = [[rng.randrange(vocab) for _ in range(n)] for n in (2, 9, 16, 17, 100)]
    ours = mixed_iteration_logits(runner, prefills, decodes, rng)
    with torch.no_grad():
        expected = torch.stack([ref(torch.tensor([seq])).logits[0, -1] for seq in prefills + decodes])
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_block_size_does_not_change_logits(backend, tiny_llama_dir):
    rng = random.Random(7)
    seqs = [[rng.randrange(512) for _ in range(n)] for n in (5, 31, 64)]
    results = []
    for bs in (1, 8, 16):
        runner = _runner(tiny_llama_dir, block_size=bs, backend=backend)
        results.append(mixed_iteration_logits(runner, seqs[:1], seqs[1:], random.Random(bs)))
    assert torch.allclose(results[0], results[1], atol=1e-5) and torch.allclose(results[0], results[2], atol=1e-5)


def test_bfloat16_decode_kernel_matches_the_torch_path(tiny_llama_dir):
    """bfloat16 weights and KV: the C++ kernel (float32 accumulate) and gather + SDPA give the same
    logits to bfloat16 rounding; both stay near the float32 engine."""
    rng = random.Random(11)
    seqs = [[rng.randrange(512) for _ in range(n)] for n in (9, 40, 3, 77, 20)]
    out = {}
    for backend, dtype in (("cpu", "bfloat16"), ("torch", "bfloat16"), ("cpu", "float32")):
        runner = _runner(tiny_llama_dir, backend=backend, dtype=dtype)
        assert runner.model.attention_backend == backend and runner.dtype == getattr(torch, dtype)
        out[backend, dtype] = mixed_iteration_logits(runner, seqs[:2], seqs[2:], random.Random(5)).float()
    scale = out["cpu", "float32"].abs().max().item()
    assert (out["cpu", "bfloat16"] - out["torch", "bfloat16"]).abs().max().item() <= 2 ** -5 * scale   # a few bf16 ulps
    assert (out["cpu", "bfloat16"] - out["cpu", "float32"]).abs().max().item() <= 2 ** -4 * scale


def test_prefill_after_cached_context_matches(tiny_llama_dir):
    """An initiation-like iteration on top of cached tokens (multi-token work at start_pos > 0)."""
    runner = _runner(tiny_llama_dir)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    seq = list(range(3, 43))
    bm = BlockManager(runner.pool)
    table = list(bm.ensure("a", len(seq)))
    runner.forward(IterationPlan(0, [SeqWork("a", seq[:25], 0, table)]))
    logits = runner.forward(IterationPlan(1, [SeqWork("a", seq[25:], 25, table)]))
    with torch.no_grad():
        expected = ref(torch.tensor([seq])).logits[0, -1]
    assert (logits[0] - expected).abs().max().item() <= 1e-4


def test_a_prompt_chunk_with_more_to_come_gets_no_logits(tiny_llama_dir):
    """Only rows that sample go through the LM head and the sampler; the others return token -1."""
    runner = _runner(tiny_llama_dir)
    plan = IterationPlan(0, [SeqWork("a", list(range(3, 20)), 0, [0, 1, 2], sample=False),
                             SeqWork("b", [5, 6, 7], 0, [3])])
    assert runner.forward(plan).shape == (1, runner.info.vocab_size)
    result = runner.execute(plan)
    assert len(result.token_ids) == 2 and result.token_ids[0] == -1 and result.token_ids[1] >= 0
    alone = IterationPlan(1, [SeqWork("c", list(range(3, 20)), 0, [4, 5, 6], sample=False)])
    assert runner.execute(alone).token_ids == [-1]


def test_too_few_blocks_is_an_error(tiny_llama_dir):
    runner = _runner(tiny_llama_dir)
    with pytest.raises(ValueError, match="cannot hold"):
        runner.forward(IterationPlan(0, [SeqWork("a", list(range(20)), 0, [0])]))


def _serve_logits(model_dir, budget: int, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, list], int]:
    """Greedy-serve the prompts through the ORCA scheduler and the engine; returns each request's
    logits at every sampled token, and how many iterations mixed a prompt chunk on cached context
    with increments."""
    from orca_mq.protocol.iteration import IterationResult
    from orca_mq.protocol.sampling import SamplingParams
    from orca_mq.sched import make_scheduler
    from orca_mq.sched.request import Request

    cfg = load_config(overrides={"model.path": str(model_dir), "engine.block_size": 8, "engine.n_slots": 2048,
                                 "engine.threads_per_worker": 1, "scheduler.max_num_batched_tokens": budget,
                                 "model.dtype": "float32"})
    runner, logits, mixed = ModelRunner(cfg), {}, 0
    sched = make_scheduler(cfg, runner.info)
    for i, p in enumerate(prompts):
        sched.add(Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival=float(i)))
    while (plan := sched.schedule(0.0)) is not None:
        out = runner.forward(plan)
        mixed += any(s.start_pos and len(s.token_ids) > 1 for s in plan.seqs) and any(
            len(s.token_ids) == 1 for s in plan.seqs)
        sampled = [s for s in plan.seqs if s.sample]   # the logits' rows: every request whose prompt is all in
        assert [s.request_id for s in sampled] == [s.request_id for s in plan.seqs if not sched.pool[s.request_id].prompt_pending]
        for s, row in zip(sampled, out, strict=True):
            logits.setdefault(s.request_id, []).append(row)
        tokens = iter(out.argmax(-1).tolist())
        sched.process_result(IterationResult(plan.iteration, [next(tokens) if s.sample else -1 for s in plan.seqs]), 0.0)
    return logits, mixed


def test_chunked_prefill_keeps_the_unchunked_logits(tiny_llama_dir):
    """A token budget splits the long prompts into chunks over several iterations, next to running
    increments: every sampled token's logits stay those of the whole-prompt engine."""
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 90, 3, 140, 37)]
    whole, _ = _serve_logits(tiny_llama_dir, 0, prompts, 6)
    chunked, mixed = _serve_logits(tiny_llama_dir, 24, prompts, 6)
    assert mixed > 0
    assert whole.keys() == chunked.keys() and all(len(chunked[r]) == 6 for r in chunked)
    for rid in whole:
        assert (torch.stack(whole[rid]) - torch.stack(chunked[rid])).abs().max().item() <= 1e-4, rid
