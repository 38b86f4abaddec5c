"""Sampling constraints and the block allocator."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels

from orca_mq.kv.block_manager import BlockManager, KVAllocationError, Match
from orca_mq.kv.pool import PoolSize
from orca_mq.protocol.iteration import SeqWork
from orca_mq.engine import sampler
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched.request import Request


@pytest.fixture(params=["kernel", "ops"])
def path(request, monkeypatch):
    """The CPU extension's step, or torch's ops (a device's path)."""
    if request.param == "ops":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    elif cpu_kernels.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    return request.param


def sample(logits: torch.Tensor, seqs: list[SeqWork]) -> list[int]:
    tokens, failed = sampler.sample_seqs(logits, seqs)
    assert failed == []
    return tokens


def seq(**kw) -> SeqWork:
    return SeqWork("r", [1], 0, [0], **kw)


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert sample(logits, [seq(temperature=0.0)] * 4) == logits.argmax(-1).tolist()
    assert sample(logits, [seq(temperature=1.0, top_k=1)] * 4) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support(path):
    torch.manual_seed(0)
    logits = torch.randn(1, 100) * 3
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    for i in range(200):
        assert sample(logits, [seq(temperature=1.0, top_k=5, seed=i)])[0] in top5
        assert sample(logits, [seq(temperature=1.0, top_p=0.5, seed=i)])[0] in nucleus
    # unrestricted sampling does leave those sets: the tests above can fail
    draws = {sample(logits, [seq(temperature=2.0, seed=i)])[0] for i in range(200)}
    assert not draws <= top5


def test_seed_gives_same_token_regardless_of_batch_row():
    logits = torch.randn(3, 1000)
    alone = sample(logits[1:2], [seq(temperature=1.0, seed=9)])
    batched = sample(logits, [seq(temperature=1.0), seq(temperature=1.0, seed=9), seq(temperature=0.0)])
    assert batched[1] == alone[0] and batched[2] == logits[2].argmax().item()


def test_sampled_tokens_follow_the_distribution(path):
    """Inverse-CDF draws over many seeds, one batch of rows (each its own seed): each token's frequency
    is its probability, top-p and a temperature included (a wrong CDF or an off-by-one in the search
    would fail this)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])
    n = 20_000

    def frequencies(**params) -> torch.Tensor:
        tokens = sample(logits.expand(n, -1).contiguous(), [seq(seed=i, **params) for i in range(n)])
        return torch.bincount(torch.tensor(tokens), minlength=6) / n

    for params, probs in (({"temperature": 1.0}, logits[0].softmax(-1)),
                          ({"temperature": 0.5}, (logits[0] / 0.5).softmax(-1))):
        freq = frequencies(**params)
        assert (freq - probs).abs().max() < 0.015, (freq, probs)
    kept = logits[0].softmax(-1)
    kept = torch.where(torch.tensor([True, True, True, False, True, False]), kept, 0)   # top_p 0.9: .56+.21+.13 < .9 keeps .08
    assert (frequencies(temperature=1.0, top_p=0.9) - kept / kept.sum()).abs().max() < 0.015
    # top-p over what top-k kept, renormalized (vLLM's and transformers' order): top 3 = .56, .21, .13 of .89, so
    # .63 + .23 reach 0.8 and keep two (without renormalizing, .56 + .21 < .8 would keep three)
    kept = torch.where(torch.tensor([True, True, False, False, False, False]), logits[0].softmax(-1), 0)
    assert (frequencies(temperature=1.0, top_k=3, top_p=0.8) - kept / kept.sum()).abs().max() < 0.015


def test_cuts_are_by_value_so_equal_tokens_share_a_fate(path):
    """top-k keeps every token equal to its k-th, top-p every one equal to its last: which of equal tokens
    stays does not depend on the sort (or the radix select) that found them."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 1.0, 1.0, -2.0, 1.0]])
    for params, support in (({"top_k": 2}, {1, 3}), ({"top_k": 3}, {1, 3, 2, 4, 5, 7}),
                            ({"top_p": 0.5}, {1, 3}), ({"top_p": 0.95}, {1, 3, 2, 4, 5, 7})):
        drawn = {sample(logits, [seq(temperature=1.0, seed=i, **params)])[0] for i in range(400)}
        assert drawn == support, params


def bitmask(vocab: int, allowed: list[int]) -> bytes:
    words = [0] * -(-vocab // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_a_row_mask_restricts_its_row_only():
    logits = torch.randn(3, 100)
    allowed = [3, 40, 97]
    masked = seq(temperature=0.0, allowed_token_bitmask=bitmask(100, allowed))
    tokens = sample(logits, [masked, seq(temperature=0.0), masked])
    assert tokens[0] == allowed[int(logits[0, allowed].argmax())] and tokens[1] == logits[1].argmax().item()
    assert tokens[2] == allowed[int(logits[2, allowed].argmax())]
    for i in range(100):   # sampled rows too, at a high temperature
        assert sample(logits[:1], [seq(temperature=5.0, seed=i, allowed_token_bitmask=bitmask(100, allowed))])[0] in allowed


def test_bad_rows_fail_alone():
    logits = torch.randn(6, 64)
    logits[1, 5], logits[4, 0], logits[5, 63] = float("nan"), float("inf"), float("-inf")
    seqs = [seq(temperature=0.0), seq(temperature=0.0), seq(temperature=1.0, seed=1, allowed_token_bitmask=bitmask(64, [])),
            seq(temperature=0.0, allowed_token_bitmask=b"\x01"), seq(temperature=0.0), seq(temperature=1.0, seed=2)]
    tokens, failed = sampler.sample_seqs(logits, seqs)   # NaN, nothing allowed, a malformed mask, +inf, -inf
    assert failed == [1, 2, 3, 4, 5] and tokens[0] == logits[0].argmax().item()


def test_block_manager_allocates_grows_and_frees():
    bm = BlockManager(PoolSize(block_size=4, device_blocks=4, host_blocks=0))
    a = Request("a", [1] * 9, SamplingParams(max_tokens=3))
    bm.start(a, Match(), 3)
    assert bm.n_rsrv == 3
    assert bm.ensure("a", 5) == [0, 1] and bm.ensure("a", 8) == [0, 1] and bm.ensure("a", 9) == [0, 1, 2]
    assert bm.n_rsrv == 3                                   # its reservation now held
    with pytest.raises(KVAllocationError, match="needs 2 more KV blocks, 1 free"):
        bm.ensure("b", 8)
    assert bm.table("b") == [] and bm.num_free_blocks == 1  # a failed allocation takes nothing
    bm.release(a)
    assert bm.table("a") == [] and bm.num_free_slots == 16 and bm.num_used_slots == 0 and bm.n_rsrv == 0
    with pytest.raises(ValueError):
        PoolSize(4, 0, 0)
