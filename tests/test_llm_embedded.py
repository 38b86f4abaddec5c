"""The offline API on the embedded SmolLM2 model: exact against transformers, clean KV afterwards, clear errors."""
from __future__ import annotations

import math

import pytest
import torch

from orca_mq import InvalidRequest, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The three primary colors are",
    "In machine learning, overfitting means that a model memorizes its training data instead of learning "
    "patterns that generalize. Common remedies include",
    "Hello",
    "Translate to French: 'Good morning, how are you?'\nFrench:",
]
MAX_TOKENS = [12, 20, 7, 16, 9, 3, 14, 5, 11]

pytestmark = pytest.mark.e2e


def test_greedy_matches_transformers_with_joins_and_leaves(embedded_llm, hf_reference):
    llm = embedded_llm
    assert llm.cfg.scheduler.max_bs < len(PROMPTS)  # requests must join and leave between iterations
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    start_iter = llm.scheduler.iteration
    outs = llm.generate(PROMPTS, params)
    for prompt, m, out in zip(PROMPTS, MAX_TOKENS, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf_reference.generate(ids, max_new_tokens=m, min_new_tokens=m, do_sample=False)[0, ids.shape[1]:]
        assert out.token_ids == ref.tolist(), f"prompt {prompt!r}"
        assert out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(ref.tolist(), skip_special_tokens=True)
    # joins and leaves really happened: some iteration mixed an initiation with increments
    batches = [ids for it, ids in llm.scheduler.record if it > start_iter]
    assert max(len(b) for b in batches) == llm.cfg.scheduler.max_bs
    assert len({frozenset(b) for b in batches}) > 3
    stats = llm.scheduler.stats()
    assert stats["free_slots"] == stats["n_slots"] and stats["used_slots"] == 0 and stats["reserved_slots"] == 0


def test_request_level_baseline_gives_the_same_greedy_tokens(embedded_llm):
    """FasterTransformer-style batches (every prompt cut to the batch's shortest in the first
    iteration, the rest fed a token an iteration; finished requests computed until the batch ends)
    change when tokens arrive, not which: the same KV, position by position."""
    from orca_mq import LLM

    baseline = LLM(policy="request", max_bs=3, n_slots=4096, dtype="float32")
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = baseline.generate(PROMPTS, params)
    assert len({len(o.prompt_token_ids) for o in outs[:3]}) == 3   # the first batch's prompts differ in length
    assert [o.token_ids for o in outs] == [o.token_ids for o in embedded_llm.generate(PROMPTS, params)]
    assert baseline.scheduler.block_manager.num_used_slots == 0


def test_eos_stops_and_chat_template(embedded_llm):
    out = embedded_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.finish_reason in ("stop", "length")
    assert out.text.strip()
    prompt = embedded_llm.tokenizer.decode(out.prompt_token_ids)
    assert "<|im_start|>user\nSay hi.<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in embedded_llm.info.eos_token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(embedded_llm):
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=42, ignore_eos=True)
    alone = embedded_llm.generate(["The weather today is"], p)[0].token_ids
    together = embedded_llm.generate(["The weather today is", "Another prompt in the batch"], [p, p])[0].token_ids
    assert alone == together
    other = embedded_llm.generate(["The weather today is"], SamplingParams(**{**p.to_dict(), "seed": 7}))[0]
    assert len(other.token_ids) == 8


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty prompt"),
        ([], SamplingParams(), "empty prompt"),
        ([1, 2, 10**6], SamplingParams(), "outside the vocabulary"),
        ([-1], SamplingParams(), "outside the vocabulary"),
        ("hi", SamplingParams(max_tokens=5000), "exceeds the context length"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", SamplingParams(temperature=-1.0), "temperature"),
        ("hi", SamplingParams(temperature=math.nan), "temperature"),
        ("hi", SamplingParams(top_p=math.nan), "top_p"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_k=-3), "top_k"),
        ("hi", SamplingParams(seed=-1), "seed"),
        ("hi", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_bad_input_is_a_clear_error(embedded_llm, prompt, params, message):
    before = embedded_llm.scheduler.stats()
    with pytest.raises(InvalidRequest, match=message):
        embedded_llm.generate([prompt], params)
    assert embedded_llm.scheduler.stats() == before


def test_request_larger_than_kv_pool_is_rejected(embedded_llm):
    # the fixture's pool (4096 slots) outgrows the context length, so check against a smaller pool
    from orca_mq.admission.served_model import ServedModel
    from orca_mq.config import load_config

    model = ServedModel(load_config(overrides={"engine.n_slots": 64}), embedded_llm.info)
    with pytest.raises(InvalidRequest, match="exceeds the KV pool of 64 slots"):
        model.fit([5] * 60, SamplingParams(max_tokens=10))
    assert model.fit([5] * 60, SamplingParams(max_tokens=None)).max_tokens == 4   # the rest of the pool
    with pytest.raises(InvalidRequest, match="leaves no room"):
        model.fit([5] * 64, SamplingParams(max_tokens=None))


def test_unknown_sampling_field_is_rejected():
    with pytest.raises(InvalidRequest, match="unknown field"):
        SamplingParams.from_dict({"max_tokens": 3, "temprature": 0.5})
