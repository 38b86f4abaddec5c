"""The CPU's fused sampling step and log probabilities (kernels/csrc/sample_cpu.cpp) against torch's ops, the path a
device takes: the same token for every row and the same failures, over rows of every kind the sampler knows; the
same log probabilities and ids."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import cpu_kernels
from orca_mq.engine import logprobs, sampler
from orca_mq.protocol.iteration import Biases, RowExtras, SeqWork, mask_bytes

VOCAB = 1003   # not a multiple of 8: the bitmask's last byte is read bit by bit


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels.load()
    if k is None:
        pytest.skip("the CPU kernels cannot be built here")
    return k


def _both(monkeypatch, logits: torch.Tensor, seqs: list[SeqWork]) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """Each path's (tokens, failed rows), a failed row's token left out (-1): it is never sent."""
    def run() -> tuple[list[int], list[int]]:
        tokens, failed = sampler.sample_seqs(logits, seqs)
        return [-1 if b in failed else t for b, t in enumerate(tokens)], failed

    fused = run()
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "load", lambda: None)
        return fused, run()


def _mask(kind: str, gen: torch.Generator) -> bytes | None:
    size = mask_bytes(VOCAB)
    if kind == "random":
        return bytes(torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8).tolist())
    if kind == "one":   # a single token: the grammar's only choice
        words = bytearray(size)
        words[37 // 8] = 1 << (37 % 8)
        return bytes(words)
    return {"none": None, "nothing": bytes(size), "malformed": b"\xff" * (size - 1)}[kind]


row = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 1e-3, 0.05, 0.7, 1.0, 2.0, 100.0, float("nan")]),   # the API's bounds; NaN: a bad plan
    "top_k": st.sampled_from([0, 0, 1, 5, 300, 2000]),   # 2000: past the vocabulary
    "top_p": st.sampled_from([1.0, 1.0, 0.5, 0.9, 0.999, 5e-324, float("nan")]),   # 5e-324: 0 in float32; NaN: a bad plan, the row fails
    "mask": st.sampled_from(["none", "none", "random", "one", "nothing", "malformed"]),
    "min_p": st.sampled_from([0.0, 0.05, 0.3]),
    "bias": st.sampled_from(["none", "none", "add", "ban", "ban_all_but"]),
    "logits": st.sampled_from(["finite", "finite", "finite", "nan", "inf", "-inf", "ties", "adjacent", "peaked", "peaked"]),
})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(row, min_size=1, max_size=6), seed=st.integers(0, 2**31), scale=st.sampled_from([0.1, 1.0, 3.0, 30.0]),
       bf16=st.booleans())
def test_the_fused_step_draws_what_the_ops_draw(kernel, monkeypatch, rows, seed, scale, bf16):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), VOCAB, generator=gen) * scale
    seqs = []
    for b, r in enumerate(rows):
        if r["logits"] == "ties":
            logits[b] = logits[b].round().clamp(max=1.0)   # many tokens at the maximum: the first is the argmax
        elif r["logits"] == "adjacent":   # pairs a float apart, which a temperature may round to one value
            grid = logits[b].round()
            logits[b] = torch.where(torch.arange(VOCAB) % 2 == 0, grid, torch.nextafter(grid, torch.tensor(9.0)))
        elif r["logits"] == "peaked":   # a model's row: a few dozen logits far above the rest (the kernel's near list)
            logits[b] /= 10
            logits[b, (7 * torch.arange(30) + b) % VOCAB] += torch.linspace(1, 16, 30)
        elif r["logits"] != "finite":
            logits[b, 11 * b + 3] = float(r["logits"])
        bias = {"none": [], "add": [(5, 4.0), (900, -2.5), (37, 1.0)],
                "ban": [(int(logits[b].argmax()), float("-inf"))],
                "ban_all_but": [(t, float("-inf")) for t in range(VOCAB) if t != 37]}[r["bias"]]
        extra = RowExtras(min_p=r["min_p"], bias=Biases.of(bias)) if r["min_p"] or bias else None
        seqs.append(SeqWork(f"r{b}", [1], 9 + b, [0], temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"],
                            seed=seed + b, allowed_token_bitmask=_mask(r["mask"], gen), extra=extra))
    if bf16:
        logits = logits.bfloat16()
    fused, ops = _both(monkeypatch, logits, seqs)
    assert fused == ops


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.9), (12, 0.95), (0, 0.999), (40, 1.0)])
def test_a_models_peaked_rows_draw_what_the_ops_draw(kernel, monkeypatch, top_k, top_p):
    """A model's row, a few dozen logits far above the rest: the kernel's cuts read their list, not the row (and
    the row again where the list holds too few for top_k, 40). 64 draws of each cut land where the ops' land."""
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(3)) / 10
    logits[:, (7 * torch.arange(30)) % VOCAB] += torch.linspace(1, 16, 30)
    seqs = [SeqWork(f"r{b}", [1], 9, [0], temperature=1.0, top_k=top_k, top_p=top_p, seed=b) for b in range(64)]
    fused, ops = _both(monkeypatch, logits, seqs)
    assert fused == ops and len(set(fused[0])) >= 3


def test_a_row_in_a_wide_vocabulary_draws_past_its_first_block(kernel, monkeypatch):
    """The inverse CDF's blocks: draws over 49,152 tokens of equal weight land everywhere, as the ops' do."""
    logits = torch.zeros(64, 49_152)
    seqs = [SeqWork(f"r{i}", [1], i, [0], temperature=1.0, seed=i) for i in range(64)]
    (fused, failed), ops = _both(monkeypatch, logits, seqs)
    assert (fused, failed) == ops and failed == [] and max(fused) > 40_000 and min(fused) < 8_000


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 5), k=st.sampled_from([0, 1, 5, 20, VOCAB]), seed=st.integers(0, 2**31),
       scale=st.sampled_from([0.1, 3.0, 30.0]), ties=st.booleans(), some=st.booleans())
def test_the_fused_log_probabilities_are_the_ops(kernel, monkeypatch, n, k, seed, scale, ties, some):
    """log_softmax at each row's target and its k largest (k = 0, and k past the fused bound: the ops): the
    values to float32's rounding of a log-sum-exp over the vocabulary, the ids exactly (equal values: the lower id
    first, as the ops' topk on the CPU gives them)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=gen) * scale
    if ties:
        logits = logits.round()
    rows = torch.tensor([b for b in range(n) if b % 2 == 0]) if some else None
    targets = torch.randint(0, VOCAB, (n if rows is None else len(rows),), generator=gen)
    fused = logprobs._compute(logits, rows, targets, k)
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "load", lambda: None)
        ops = logprobs._compute(logits, rows, targets, k)
    tol = 8 * 2 ** -24 * max(32.0, float(logits.abs().max()) * 2)   # a few ulps of the largest value subtracted
    assert torch.allclose(fused[0], ops[0], rtol=0, atol=tol) and torch.allclose(fused[1], ops[1], rtol=0, atol=tol)
    assert fused[2].shape == ops[2].shape
    if not ties:
        assert torch.equal(fused[2], ops[2])
    else:   # equal values in either order: each id's own value is the one listed
        lp = torch.log_softmax(logits if rows is None else logits[rows], -1)
        assert torch.allclose(lp.gather(1, fused[2]), ops[1], rtol=0, atol=tol)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 5), seed=st.integers(0, 2**31), scale=st.sampled_from([0.1, 3.0, 30.0]),
       biases=st.lists(st.tuples(st.integers(0, 4), st.integers(0, VOCAB - 1),
                                 st.sampled_from([1.0, -2.5, 100.0, -100.0, 0.3, float("-inf")])), max_size=40),
       ban_all=st.booleans(), penalized=st.lists(st.booleans(), min_size=5, max_size=5),
       penalty=st.tuples(st.sampled_from([0.0, -2.0, 0.7, 2.0]), st.sampled_from([0.0, -1.3, 0.3, 2.0]),
                         st.sampled_from([1.0, 0.01, 1.3, 100.0])))
def test_the_fused_processors_are_the_ops_to_the_bit(kernel, n, seed, scale, biases, ban_all, penalized, penalty):
    """logit_bias, min_tokens' bans (a row they would leave with no token keeps its logits) and the penalties over a
    history: the extension's one call (kernels/csrc/processors_cpu.cpp) gives the ops' logits exactly, -inf included."""
    from orca_mq.engine.history import Processors, TokenHistory

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=gen) * scale
    entries = [(r, t, v) for r, t, v in biases if r < n]
    if ban_all:   # every token of row 0 banned: the row keeps what it had
        entries += [(0, t, float("-inf")) for t in range(VOCAB)]
    history = TokenHistory(VOCAB, torch.device("cpu"))
    pen_rows = [r for r in range(n) if penalized[r]]
    for r in pen_rows:
        history._alloc(f"r{r}")
    history.counts = torch.randint(0, 3, history.counts.shape, generator=gen, dtype=torch.int32)
    history.seen = torch.rand(history.seen.shape, generator=gen) < 0.2
    procs = Processors(np.array([e[0] for e in entries], np.int64), np.array([e[1] for e in entries], np.int64),
                       np.array([e[2] for e in entries], np.float32), np.array(pen_rows, np.int64),
                       [f"r{r}" for r in pen_rows], np.array([penalty] * len(pen_rows), np.float32).reshape(-1, 3),
                       np.zeros(n, np.float32))
    fused, ops = procs.apply(logits, history, kernel), procs.apply(logits, history)
    assert torch.equal(fused, ops)
    if ban_all:
        assert torch.isfinite(fused[0]).any()


@pytest.mark.parametrize("path", ["kernel", "ops"])
def test_a_malformed_plans_values_fail_their_rows_alone(kernel, monkeypatch, path):
    """Values the API never sends (a min-p past 1, biases that overflow to +inf, a negative temperature) fail
    their own rows on both paths, the other rows drawn; a bias outside the vocabulary is refused before it
    reaches an index (on a device, an out-of-range index is an assert that ends the process)."""
    if path == "ops":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    seqs = [SeqWork("ok", [1], 9, [0], temperature=1.0, seed=1),
            SeqWork("min_p", [1], 9, [0], temperature=1.0, seed=2, extra=RowExtras(min_p=2.0)),
            SeqWork("inf", [1], 9, [0], temperature=1.0, seed=3, extra=RowExtras(bias=Biases.of([(5, 3e38), (5, 3e38)]))),
            SeqWork("cold", [1], 9, [0], temperature=-1.0, seed=4)]
    tokens, failed = sampler.sample_seqs(logits, seqs)
    assert failed == [1, 2, 3] and 0 <= tokens[0] < VOCAB
    far = [SeqWork("far", [1], 9, [0], temperature=1.0, extra=RowExtras(bias=Biases.of([(VOCAB, 1.0)])))]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler.sample_seqs(logits[:1], far)
