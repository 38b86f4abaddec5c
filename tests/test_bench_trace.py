"""Trace generation: distributions, bounds, determinism, prompts (no tokenizer, no model)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from orca_mq.bench.trace import (
    TraceSpec,
    build_prompts,
    gamma_arrivals,
    load_corpus,
    make_trace,
    parse_range,
    poisson_arrivals,
    uniform_lengths,
    zipf_lengths,
    zipf_pmf,
)

CORPUS = list(range(1000, 6000))  # stand-in for tokenized text: 5000 distinct "token ids"


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def test_poisson_interarrival_mean_and_cv():
    n, rate = 20001, 4.0
    arr = poisson_arrivals(rng(1), n, rate)
    assert arr[0] == 0.0 and np.all(np.diff(arr) >= 0)
    gaps = np.diff(arr)
    # mean of 20000 exponential gaps: relative std error 1/sqrt(20000) ~ 0.7 %; allow 5 sigma
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.035)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV = 1


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_gamma_interarrival_mean_and_cv(cv):
    n, rate = 40001, 2.0
    gaps = np.diff(gamma_arrivals(rng(2), n, rate, cv))
    # std error of the mean is cv/sqrt(n) relative; the sample CV converges slower for heavy tails
    assert gaps.mean() == pytest.approx(1 / rate, rel=5 * cv / math.sqrt(n - 1))
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_gamma_cv_zero_is_deterministic():
    arr = gamma_arrivals(rng(), 5, 2.0, 0.0)
    np.testing.assert_allclose(arr, [0.0, 0.5, 1.0, 1.5, 2.0])


@pytest.mark.parametrize("rate", [0.0, math.inf])
def test_all_at_once(rate):
    assert np.all(poisson_arrivals(rng(), 10, rate) == 0)
    assert np.all(gamma_arrivals(rng(), 10, rate, 2.0) == 0)


def test_uniform_lengths_bounds_and_coverage():
    x = uniform_lengths(rng(3), 20000, 32, 512)
    assert x.min() == 32 and x.max() == 512  # inclusive at both ends, and every draw inside
    assert x.mean() == pytest.approx((32 + 512) / 2, rel=0.02)
    assert np.all(uniform_lengths(rng(), 100, 7, 7) == 7)


def test_zipf_pmf_definition():
    p = zipf_pmf(1, 4, 1.0)  # ∝ 1, 1/2, 1/3, 1/4
    np.testing.assert_allclose(p, np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12))
    np.testing.assert_allclose(zipf_pmf(5, 9, 0.0), np.full(5, 0.2))  # θ = 0: uniform


@pytest.mark.parametrize("theta", [0.5, 1.0, 1.5])
def test_zipf_skew(theta):
    lo, hi, n = 10, 19, 50000
    x = zipf_lengths(rng(4), n, lo, hi, theta)
    assert x.min() >= lo and x.max() <= hi
    counts = np.bincount(x - lo, minlength=hi - lo + 1)
    assert counts.argmax() == 0  # the smallest value is the most frequent
    assert np.all(np.diff(counts) < 0)  # and frequencies strictly decrease
    np.testing.assert_allclose(counts / n, zipf_pmf(lo, hi, theta), atol=0.01)


def test_zipf_larger_theta_is_more_skewed():
    means = [zipf_lengths(rng(5), 20000, 1, 512, t).mean() for t in (0.0, 0.5, 1.0, 2.0)]
    assert means == sorted(means, reverse=True)


def test_prompts_exact_length_and_distinct_windows():
    lengths = [5, 1, 300, 17, 5]
    prompts = build_prompts(rng(6), CORPUS, lengths)
    assert [len(p) for p in prompts] == lengths
    flat = [t for p in prompts for t in p]
    assert len(set(flat)) == len(flat)  # consecutive windows do not overlap before the wrap
    for p in prompts:  # each window is a contiguous piece of the corpus ring
        assert all((b - a) % len(CORPUS) == 1 for a, b in zip(p, p[1:]))


def test_prompts_wrap_around_a_short_corpus():
    prompts = build_prompts(rng(7), [1, 2, 3], [7, 2])
    assert [len(p) for p in prompts] == [7, 2]
    assert set(prompts[0]) == {1, 2, 3}


@pytest.mark.parametrize("kind", ["orca", "fastserve"])
def test_same_seed_same_trace_different_seed_different(kind):
    spec = TraceSpec(kind=kind, num_requests=50, rate=3.0, cv=2.0, zipf=1.1, seed=11)
    a, b = make_trace(spec, CORPUS), make_trace(spec, CORPUS)
    assert a == b
    c = make_trace(TraceSpec(kind=kind, num_requests=50, rate=3.0, cv=2.0, zipf=1.1, seed=12), CORPUS)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    assert [r.max_tokens for r in a] != [r.max_tokens for r in c]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


@pytest.mark.parametrize("kind", ["orca", "fastserve"])
def test_rate_only_rescales_arrivals(kind):
    """ORCA §6.2: same requests at every load, arrival times scaled by the rate."""
    def trace(rate, cv=2.0):
        return make_trace(TraceSpec(kind=kind, num_requests=40, rate=rate, cv=cv, seed=3), CORPUS)

    slow, fast, burst = trace(1.0), trace(4.0), trace(math.inf)
    for other in (fast, burst, trace(1.0, cv=0.5)):
        assert [(r.prompt_token_ids, r.max_tokens) for r in other] == [(r.prompt_token_ids, r.max_tokens) for r in slow]
    np.testing.assert_allclose([r.arrival_s * 4 for r in fast], [r.arrival_s for r in slow])
    assert all(r.arrival_s == 0 for r in burst)


@pytest.mark.parametrize("kind", ["orca", "fastserve"])
@pytest.mark.parametrize("seed", range(5))
def test_trace_bounds(kind, seed):
    spec = TraceSpec(kind=kind, num_requests=200, rate=10.0, cv=3.0, zipf=0.8,
                     input_len=(32, 512), output_len=(1, 128), seed=seed)
    trace = make_trace(spec, CORPUS)
    assert len(trace) == 200 and [r.index for r in trace] == list(range(200))
    arr = [r.arrival_s for r in trace]
    assert arr[0] == 0.0 and arr == sorted(arr)
    assert all(32 <= r.input_len <= 512 for r in trace)
    assert all(1 <= r.max_tokens <= 128 for r in trace)
    assert all(set(r.prompt_token_ids) <= set(CORPUS) for r in trace)


def test_orca_defaults_are_the_paper_ranges():
    spec = TraceSpec()
    assert (spec.kind, spec.input_len, spec.output_len) == ("orca", (32, 512), (1, 128))


def test_spec_validation():
    for bad in (dict(kind="x"), dict(num_requests=0), dict(rate=-1.0), dict(cv=-1.0),
                dict(input_len=(0, 4)), dict(output_len=(5, 4))):
        with pytest.raises(ValueError):
            TraceSpec(**bad).validate()


def test_parse_range():
    assert parse_range("32:512") == (32, 512)
    assert parse_range("8") == (8, 8)
    for bad in ("5:4", "0:3", "a:b", "1:2:3"):
        with pytest.raises(ValueError):
            parse_range(bad)


class _CharTokenizer:
    """Stand-in for a transformers tokenizer: one id per character; id of "#" is special."""
    all_special_ids = [ord("#")]

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_load_corpus_uses_stdlib_text_without_special_tokens():
    from pydoc_data.topics import topics

    ids = load_corpus(_CharTokenizer())
    assert len(ids) > 100_000 and ord("#") not in ids
    first = sorted(topics)[0]
    assert "".join(map(chr, ids[:50])) == topics[first].replace("#", "")[:50]
