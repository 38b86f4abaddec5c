"""The CPU's fused sampling step (kernels/csrc/sample_cpu.cpp) against the sampler's torch ops, the path a device
takes: the same token for every row and the same failures, over rows of every kind the sampler knows."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_mq.engine import sampler
from orca_mq.protocol.iteration import RowExtras, SeqWork, mask_bytes

VOCAB = 1003   # not a multiple of 8: the bitmask's last byte is read bit by bit


@pytest.fixture(scope="module")
def kernel():
    k = sampler._kernel()
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
        m.setattr(sampler, "_kernel", lambda: None)
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
    "top_k": st.sampled_from([0, 0, 1, 5]),
    "top_p": st.sampled_from([1.0, 1.0, 0.5]),
    "mask": st.sampled_from(["none", "none", "random", "one", "nothing", "malformed"]),
    "min_p": st.sampled_from([0.0, 0.05, 0.3]),
    "bias": st.sampled_from(["none", "none", "add", "ban", "ban_all_but"]),
    "logits": st.sampled_from(["finite", "finite", "finite", "nan", "inf", "-inf", "ties"]),
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
        elif r["logits"] != "finite":
            logits[b, 11 * b + 3] = float(r["logits"])
        bias = {"none": [], "add": [(5, 4.0), (900, -2.5), (37, 1.0)],
                "ban": [(int(logits[b].argmax()), float("-inf"))],
                "ban_all_but": [(t, float("-inf")) for t in range(VOCAB) if t != 37]}[r["bias"]]
        extra = RowExtras(min_p=r["min_p"], bias=bias) if r["min_p"] or bias else None
        seqs.append(SeqWork(f"r{b}", [1], 9 + b, [0], temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"],
                            seed=seed + b, allowed_token_bitmask=_mask(r["mask"], gen), extra=extra))
    if bf16:
        logits = logits.bfloat16()
    fused, ops = _both(monkeypatch, logits, seqs)
    assert fused == ops


def test_a_row_in_a_wide_vocabulary_draws_past_its_first_block(kernel, monkeypatch):
    """The inverse CDF's blocks: draws over 49,152 tokens of equal weight land everywhere, as the ops' do."""
    logits = torch.zeros(64, 49_152)
    seqs = [SeqWork(f"r{i}", [1], i, [0], temperature=1.0, seed=i) for i in range(64)]
    (fused, failed), ops = _both(monkeypatch, logits, seqs)
    assert (fused, failed) == ops and failed == [] and max(fused) > 40_000 and min(fused) < 8_000
