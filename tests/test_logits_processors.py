"""The logits processors (presence / frequency / repetition penalties, min_tokens, min_p, logit_bias)
end to end on the real engine in fp32, against transformers' own processors or a hand computation of
the definition on transformers' raw logits; planned ahead (async scheduling) and through the prefix
cache they give the same tokens; validation bounds every new field."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from orca_mq import LLM, SamplingParams
from orca_mq.engine import sampler
from orca_mq.engine.history import TokenHistory
from orca_mq.errors import InvalidRequest
from orca_mq.protocol.iteration import HISTORY_KEEP, HISTORY_START, IterationPlan, RowExtras, SeqWork, pack

N = 12


@pytest.fixture(scope="module")
def ref(tiny_served_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_served_dir, dtype=torch.float32).eval()


def _llm(model_dir, **kw) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_bs=4, n_slots=2048, **kw)


@torch.no_grad()
def _hand(ref, prompt: list[int], n: int, *, rep: float = 1.0, pres: float = 0.0, freq: float = 0.0,
          seen: list[int] | None = None, stop: set[int] = frozenset()) -> list[int]:
    """Greedy decoding with the definitions applied to transformers' raw logits: repetition_penalty over
    `seen` (default: the prompt) and the output, then OpenAI's presence / frequency over the output."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = ref(torch.tensor([ids])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float() if out else torch.zeros_like(logits)
        past = torch.zeros_like(logits, dtype=torch.bool)
        past[torch.tensor((prompt if seen is None else seen) + out, dtype=torch.long)] = True
        logits = torch.where(past, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - freq * counts - pres * (counts > 0).float()
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
        if t in stop:
            break
    return out


def _prompts(seed: int, k: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 3000) for _ in range(rng.randint(5, 40))] for _ in range(k)]


@pytest.mark.parametrize("ahead,graphs", [("off", "off"), ("on", "off"), ("on", "on")])
def test_repetition_penalty_is_transformers(tiny_served_dir, ref, ahead, graphs):
    """Greedy with repetition_penalty=1.3 is transformers' generate(repetition_penalty=1.3), a plain
    greedy row beside it is plain greedy; planned ahead (placeholders) and with padded graph buffers too."""
    llm = _llm(tiny_served_dir, max_num_batched_tokens=32, async_scheduling=ahead, cuda_graphs=graphs)
    eos = llm.info.eos_token_ids
    prompts = _prompts(1)
    params = [SamplingParams(max_tokens=N, temperature=0, repetition_penalty=1.3) for _ in prompts]
    params[1] = SamplingParams(max_tokens=N, temperature=0)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    changed = False
    for i, (prompt, got) in enumerate(zip(prompts, ours)):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               do_sample=False, max_new_tokens=N, repetition_penalty=1.3 if i != 1 else 1.0,
                               eos_token_id=eos, pad_token_id=eos[0])
        assert got == out[0, len(prompt):].tolist(), f"prompt {i}"
        changed |= i != 1 and got != _hand(ref, prompt, N, stop=set(eos))
    assert changed, "the penalty changed no token: the test would not see it missing"
    assert set(llm.runner.history.slots) <= set(llm.scheduler.released)   # the rest the next plan releases
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0))
    assert len(llm.runner.history) == 0 and llm.scheduler.released == []


def test_repetition_penalty_sees_prompt_tokens_the_prefix_cache_skipped(tiny_served_dir, ref):
    """A request whose prompt's first blocks come from the prefix cache penalizes those tokens too
    (sent once to the last stage beside its first row)."""
    llm = _llm(tiny_served_dir, block_size=16, max_num_batched_tokens=24)
    tail = [8, 9, 10, 11]
    head = _hand(ref, _prompts(3, 1)[0], 32)[:32]
    head = (_hand(ref, head + tail, N, rep=3, seen=tail) + head)[:32]   # two blocks holding what a miss would generate
    first, second = head + [5, 6, 7], head + tail
    llm.generate([first], SamplingParams(max_tokens=2, temperature=0))
    [out] = llm.generate([second], SamplingParams(max_tokens=N, temperature=0, repetition_penalty=3, ignore_eos=True))
    assert llm.scheduler.finished[out.request_id]["cached_tokens"] == 32
    assert out.token_ids == _hand(ref, second, N, rep=3)
    assert out.token_ids != _hand(ref, second, N, rep=3, seen=tail), "the cached tokens made no difference"


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_presence_and_frequency_penalties_are_openais(tiny_served_dir, ref, ahead):
    """logits[t] -= presence * (count[t] > 0) + frequency * count[t] over the generated tokens, by hand on
    transformers' logits; rows with different penalties and none share the batch."""
    llm = _llm(tiny_served_dir, max_num_batched_tokens=16, async_scheduling=ahead)
    prompts = _prompts(3)
    cases = [(0.7, 0.4), (0.0, 1.5), (-0.5, 0.0), (0.0, 0.0)]
    params = [SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, presence_penalty=p, frequency_penalty=f)
              for p, f in cases]
    for prompt, out, (p, f) in zip(prompts, llm.generate(prompts, params), cases):
        assert out.token_ids == _hand(ref, prompt, N, pres=p, freq=f), (p, f)
    assert _hand(ref, prompts[1], N, freq=1.5) != _hand(ref, prompts[1], N)   # the penalty mattered


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(tiny_served_dir, ref, ahead):
    """logit_bias makes EOS (or a stop id) the argmax: min_tokens holds it off exactly that many tokens,
    as transformers' min_new_tokens + sequence_bias; planned ahead, the count includes the placeholder's."""
    llm = _llm(tiny_served_dir, async_scheduling=ahead)
    eos = llm.info.eos_token_ids
    prompts = _prompts(4, 3)
    params = [SamplingParams(max_tokens=N, temperature=0, min_tokens=5, logit_bias={eos[0]: 100}),
              SamplingParams(max_tokens=N, temperature=0, min_tokens=3, stop_token_ids=[77], logit_bias={77: 100}),
              SamplingParams(max_tokens=N, temperature=0, logit_bias={eos[0]: 100})]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [6, 4, 1] and [o.finish_reason for o in outs] == ["stop"] * 3
    assert outs[0].token_ids[-1] == eos[0] and outs[1].token_ids[-1] == 77 and eos[0] not in outs[0].token_ids[:-1]
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompts[0]]), attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long),
                                do_sample=False, max_new_tokens=N, min_new_tokens=5, sequence_bias={(eos[0],): 100.0},
                                eos_token_id=eos, pad_token_id=eos[0])
    assert outs[0].token_ids == expected[0, len(prompts[0]):].tolist()


def test_logit_bias_is_added_to_the_logits(tiny_served_dir, ref):
    """+100 forces a token; moderate biases are transformers' sequence_bias on single tokens."""
    llm = _llm(tiny_served_dir)
    prompts = _prompts(5, 2)
    plain = _hand(ref, prompts[1], N)
    bias = {t: 0.5 * (i % 5 - 2) for i, t in enumerate(range(3, 2000, 7))} | {plain[0]: -5.0}
    forced, biased = llm.generate(prompts, [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={"42": 100}),
                                            SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logit_bias=bias)])
    assert forced.token_ids == [42] * 6
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompts[1]]), attention_mask=torch.ones(1, len(prompts[1]), dtype=torch.long),
                                do_sample=False, max_new_tokens=N, min_new_tokens=N, pad_token_id=0,
                                sequence_bias={(t,): b for t, b in bias.items() if b}, eos_token_id=llm.info.eos_token_ids)
    assert biased.token_ids == expected[0, len(prompts[1]):].tolist()
    assert biased.token_ids != plain   # the biases mattered


def _expected_draw(logits: torch.Tensor, temperature: float, min_p: float, seed: int, position: int) -> int:
    """The sampler's inverse CDF by hand, over vLLM's min-p filter of softmax(logits / temperature)."""
    probs = (logits.double() / temperature).softmax(-1)
    probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
    cum = probs.cumsum(-1)
    return int(torch.searchsorted(cum, sampler.uniform(seed, position) * cum[-1], right=True))


def test_min_p_by_hand_in_the_sampler():
    torch.manual_seed(0)
    logits = torch.randn(1, 300)
    probs = logits[0].softmax(-1)
    kept = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    draws = []
    for seed in range(300):
        row = SeqWork("r", [1], 9, [0], temperature=1.0, seed=seed, extra=RowExtras(min_p=0.2))
        [token], failed = sampler.sample_seqs(logits, [row])
        assert failed == [] and token == _expected_draw(logits[0], 1.0, 0.2, seed, 10)
        draws.append(token)
    assert set(draws) <= kept and len(set(draws)) > 1
    unfiltered = {sampler.sample_seqs(logits, [SeqWork("r", [1], 9, [0], temperature=1.0, seed=s)])[0][0] for s in range(300)}
    assert not unfiltered <= kept   # without min_p the draws leave the kept set: the filter did something


def test_min_p_end_to_end_by_hand(tiny_served_dir, ref):
    """Seeded sampling with min_p over the real engine: each token is the hand-computed draw from
    transformers' logits of the prompt and the tokens so far."""
    llm = _llm(tiny_served_dir)
    [prompt] = _prompts(6, 1)
    [out] = llm.generate([prompt], SamplingParams(max_tokens=N, temperature=0.05, min_p=0.3, seed=11, ignore_eos=True))
    ids = list(prompt)
    with torch.no_grad():
        for i, token in enumerate(out.token_ids):
            logits = ref(torch.tensor([ids])).logits[0, -1]
            assert token == _expected_draw(logits, 0.05, 0.3, 11, len(prompt) + i), f"token {i}"
            ids.append(token)


def test_a_lost_history_fails_its_row_and_released_ones_are_dropped():
    """A row that continues a history this stage does not hold (a restarted worker) fails; a released
    request's rows go back to the free list."""
    hist = TokenHistory(50, torch.device("cpu"))
    start = IterationPlan(1, [SeqWork("a", [1, 2, 3], 0, [0], extra=RowExtras(repetition=1.2, history=HISTORY_START, seen=[4]))])
    assert hist.begin(pack(start).arrays()) == [] and len(hist) == 1
    assert hist.seen[hist.slots["a"]].nonzero().flatten().tolist() == [1, 2, 3, 4]
    keep = IterationPlan(2, [SeqWork("b", [5], 3, [0], extra=RowExtras(presence=1.0, history=HISTORY_KEEP)),
                             SeqWork("c", [5], 3, [0])], released=["a"])
    assert hist.begin(pack(keep).arrays()) == [0] and set(hist.slots) == {"b"}


def test_validation_bounds_every_new_field():
    ok = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01, min_p=1, min_tokens=16,
                        logit_bias={0: -100, "511": 100.0})
    ok.validate(512)
    assert ok.logit_bias == {"0": -100, "511": 100.0}   # keys travel as decimal strings (JSON's, msgpack's maps)
    for bad, word in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                      ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": -0.1}, "min_p"),
                      ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 17}, "must not exceed max_tokens"),
                      ({"logit_bias": {"512": 1}}, "logit_bias"), ({"logit_bias": {"01": 1}}, "logit_bias"),
                      ({"logit_bias": {"5": 100.5}}, "logit_bias"), ({"logit_bias": {"5": True}}, "logit_bias"),
                      ({"logit_bias": [[5, 1]]}, "logit_bias"), ({"min_p": "0.5"}, "min_p")]:
        with pytest.raises(InvalidRequest, match=word):
            SamplingParams(**bad).validate(512)
    big = SamplingParams(logit_bias={t: 1 for t in range(40)})
    big.validate(512)
    with pytest.raises(InvalidRequest, match="at most 10 token ids"):
        big.validate_logit_bias(10)
    assert not SamplingParams().processed and np.float32(SamplingParams().repetition_penalty) == 1


def test_rows_without_processors_cost_nothing_extra():
    """A plan whose rows ask for none carries no processor column, and a greedy iteration's step is
    the greedy one alone (the tensor a CUDA graph already computed, nothing else launched); a row with
    only min_tokens reached, or min_p on a greedy row, is the same."""
    logits = torch.randn(3, 64)
    first = sampler.greedy(logits)
    plain = [SeqWork(f"r{i}", [1], 3, [0]) for i in range(3)]
    done = RowExtras(min_p=0.0)   # e.g. min_tokens already reached: the row's RowExtras has nothing to apply
    greedy_min_p = SeqWork("r", [1], 3, [0], extra=RowExtras(min_p=0.5))
    for seqs in (plain, [*plain[:2], SeqWork("r", [1], 3, [0], extra=done)], [greedy_min_p, *plain[:2]]):
        packed = pack(IterationPlan(1, seqs))
        rows = sampler.SamplingRows.of(packed.arrays())
        assert rows.processors is None and sampler.sample(logits, rows, first).back is first
    assert not any(getattr(pack(IterationPlan(1, plain)), n) for n in ("x_rows", "x_params", "bias_ids", "seen_ids"))
