"""Log probabilities are the model's own: the engine's (offline LLM, the same scheduler and engine as
the server) equal log_softmax of transformers' float32 logits, for sampled tokens and their top k
and for a prompt's positions (echo), whatever the temperature, the chunking or the prefix cache;
the wire carries them to clients of v5 and drops them for older ones.

Tolerance: the engine's float32 logits equal transformers' to LOGIT_TOL (the bound of
test_engine_exact, selective batching against one request alone); log_softmax(x)_i = x_i -
logsumexp(x) moves by at most |dx_i| + max|dx| <= 2 LOGIT_TOL, plus the float32 rounding of the
subtraction and of the logsumexp reduction over the vocabulary (a few ulps of values below 2^5).
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from orca_mq import LLM
from orca_mq.errors import InvalidRequest
from orca_mq.protocol import ProtocolError, decode, encode
from orca_mq.protocol.client_msgs import TO_CLIENT, Final, Outputs
from orca_mq.protocol.iteration import IterationPlan, SeqWork, pack
from orca_mq.protocol.logprobs import Logprobs
from orca_mq.protocol.sampling import SamplingParams

LOGIT_TOL = 1e-4
TOL = 2 * LOGIT_TOL + 8 * 2 ** -24 * 32


def _reference(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the whole sequence, float32: row i predicts token i+1."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_position(lp: torch.Tensor, token: int, logprob: float, top_ids: list[int], top_lps: list[float], k: int) -> None:
    assert abs(logprob - lp[token].item()) <= TOL
    assert len(top_ids) == len(top_lps) == k
    want = lp.topk(k).values
    assert torch.allclose(torch.tensor(top_lps), want, rtol=0, atol=TOL)          # the k largest values...
    assert all(abs(lp[t].item() - v) <= TOL for t, v in zip(top_ids, top_lps))     # ...of the tokens it names
    assert top_lps == sorted(top_lps, reverse=True)


@pytest.fixture(scope="module")
def llm(tiny_served_dir):
    # a token budget of 16 feeds the long prompts in chunks: prompt positions span iterations
    return LLM(model=str(tiny_served_dir), dtype="float32", max_bs=4, n_slots=2048, max_num_batched_tokens=16,
               threads_per_worker=1)


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.7, top_k=5, top_p=0.9, seed=3)])
def test_sampled_and_prompt_logprobs_equal_transformers(llm, tiny_served_dir, params):
    rng = random.Random(5)
    vocab = llm.info.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 40)]
    sp = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=4, prompt_logprobs=3, **params)
    outs = llm.generate(prompts, sp)
    for prompt, out in zip(prompts, outs):
        lp = _reference(tiny_served_dir, prompt + out.token_ids)
        g = out.logprobs
        assert g is not None and g.token_ids == out.token_ids and g.consistent()
        for j, token in enumerate(out.token_ids):   # raw logits: not the temperature's, top-k's or top-p's
            _check_position(lp[len(prompt) - 1 + j], token, g.logprobs[j], g.top_ids[j], g.top_logprobs[j], 4)
            assert g.tokens[j] == llm.tokenizer.decode([token], skip_special_tokens=False)
        p = out.prompt_logprobs
        assert p is not None and p.token_ids == prompt and p.consistent()
        assert p.logprobs[0] is None and p.top_ids[0] == []
        for i in range(1, len(prompt)):
            _check_position(lp[i - 1], prompt[i], p.logprobs[i], p.top_ids[i], p.top_logprobs[i], 3)


def test_zero_asks_only_the_tokens_own_and_the_prefix_cache_is_not_read(llm, tiny_served_dir):
    rng = random.Random(9)
    prompt = [rng.randrange(3, llm.info.vocab_size) for _ in range(48)]   # three whole blocks of 16
    llm.generate([prompt], SamplingParams(max_tokens=1))                  # publishes its blocks
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, logprobs=0, prompt_logprobs=0))[0]
    lp = _reference(tiny_served_dir, prompt + out.token_ids)
    assert out.logprobs.top_ids == [[], []] and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):   # every position computed, none taken from the cache
        assert abs(out.prompt_logprobs.logprobs[i] - lp[i - 1, prompt[i]].item()) <= TOL
    plain = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert plain.logprobs is None and plain.prompt_logprobs is None and plain.token_ids == out.token_ids


def test_rows_that_ask_nothing_add_no_columns():
    seqs = [SeqWork("a", [1, 2, 3], 0, [0]), SeqWork("b", [4], 7, [1])]
    packed = pack(IterationPlan(1, seqs))
    assert packed.logprobs == packed.prompt_logprobs == packed.next_tokens == b""
    a = packed.arrays()
    assert a.logprobs is None and a.prompt_logprobs is None
    seqs[0].prompt_logprobs, seqs[0].next_token, seqs[1].logprobs = 2, 9, 0
    a = pack(IterationPlan(2, seqs)).arrays()
    assert a.logprobs.tolist() == [-1, 0] and a.prompt_logprobs.tolist() == [2, -1] and a.next_tokens.tolist() == [9, -1]


def test_bounds_are_checked_once_at_admission(llm):
    for bad in (-1, 21, 2.0, True, "3"):
        with pytest.raises(InvalidRequest, match="logprobs"):
            llm.model.params({"logprobs": bad})
        with pytest.raises(InvalidRequest, match="prompt_logprobs"):
            llm.model.params({"prompt_logprobs": bad})
    assert llm.model.params({"logprobs": 20, "prompt_logprobs": 0}).logprobs == 20


def test_outputs_carry_logprobs_to_v5_clients_only():
    lp = Logprobs([5, 6], ["a", "b"], [-0.5, -1.25], [[5, 7], [6, 8]], [["a", "c"], ["b", "d"]], [[-0.5, -2.0], [-1.25, -3.0]])
    head = Logprobs([1], ["<s>"], [None], [[]], [[]], [[]])
    msg = Outputs(["r1", "r2"], [[5, 6], [9]], ["ab", "x"], [None, Final("length")], [lp, None], [head, None])
    back = decode(encode(msg), TO_CLIENT)
    rows = back.rows()
    assert rows[0].logprobs == lp and rows[0].prompt_logprobs == head and rows[1].logprobs is None
    assert rows[0].logprobs.top(0) == {"a": -0.5, "c": -2.0}
    old = decode(encode(msg, 4), TO_CLIENT)   # a v4 client: the same frame without them
    assert old.logprobs == [] and old.rows()[0].token_ids == [5, 6]
    plain = Outputs(["r"], [[1]], ["a"], [None])
    assert decode(encode(plain), TO_CLIENT).logprobs == []
    msg.logprobs = [lp]   # one entry for two rows
    with pytest.raises(ProtocolError, match="neither empty"):
        decode(encode(msg), TO_CLIENT)
