"""The scheduling scorecard's arithmetic (orca_mq/bench/scorecard.py): medians of per-round ratios,
throughput at a latency along a curve, one composition's cost, the capacity at full batch, the
rotation of the policies' order, and issue 21's targets judged."""
import math

import pytest

from orca_mq.bench.scorecard import (CONTROL, aggregate, full_batch_capacity, judge, mean_lengths, round_order,
                                     server_of, shape_cost_ratio, throughput_at, trace_spec)
from orca_mq.bench.trace import make_trace


def run(trace, load, rnd, policy, **m):
    return {"trace": trace, "load": load, "round": rnd, "policy": policy, "summary": m}


def test_ratios_are_taken_round_by_round_then_the_median():
    # the machine is twice as slow in round 1: absolute medians move, the per-round ratio does not
    runs = [run("orca", 1.0, 0, "orca", jct_mean_s=1.0), run("orca", 1.0, 0, "fastserve", jct_mean_s=0.5),
            run("orca", 1.0, 1, "orca", jct_mean_s=2.0), run("orca", 1.0, 1, "fastserve", jct_mean_s=1.0),
            run("orca", 1.0, 2, "orca", jct_mean_s=4.0), run("orca", 1.0, 2, "fastserve", jct_mean_s=2.0)]
    cell = aggregate(runs)["orca"]["1"]["fastserve"]
    assert cell["jct_mean_s/orca"] == 0.5 and cell["jct_mean_s"] == 1.0 and cell["rounds"] == 3


def test_throughput_at_a_latency():
    curve = [(0.05, 100.0), (0.10, 300.0), (0.30, 400.0)]
    assert throughput_at(curve, 0.075) == (pytest.approx(200.0), "=")
    assert throughput_at(curve, 1.0) == (400.0, ">=")       # beyond its slowest point: a lower bound
    assert math.isnan(throughput_at(curve, 0.01)[0])


def test_one_composition_costs_the_same_only_where_both_have_samples():
    orca = [[8, 0, 10.0]] * 5 + [[0, 200, 50.0]] * 5
    fast = [[9, 0, 11.0]] * 5 + [[30, 0, 99.0]] * 2          # (28-31 decodes): too few samples, ignored
    r = shape_cost_ratio(fast, orca)
    assert r["ratio"] == pytest.approx(1.1) and r["iterations"] == 5


def test_targets_by_what_the_oracle_can_gain():
    agg = {"fastserve": {"1": {"orca": {"jct_mean_s": 10.0}, "srpt": {"jct_mean_s": 4.0, "jct_mean_s/orca": 0.4},
                               "fastserve": {"jct_mean_s": 7.0, "jct_mean_s/orca": 0.7, "jct_p99_s/orca": 1.0,
                                             "itl_p50_s/orca": 1.2}}},
           "orca": {"0.5": {"orca": {"jct_mean_s": 1.0, "norm_latency_p50_s": 0.05, "throughput_tok_s": 400.0},
                            "srpt": {"jct_mean_s": 1.0, "jct_mean_s/orca": 1.0},
                            "fastserve": {"jct_mean_s": 1.02, "jct_mean_s/orca": 1.02, "itl_p50_s/orca": 1.0},
                            "request": {"norm_latency_p50_s": 0.05, "throughput_tok_s": 100.0}}}}
    rows = {(r["what"], r["where"]): r["met"] for r in judge(agg, {"fastserve": 1.02, "orca": None})}
    assert rows[("fastserve mean JCT / orca's (oracle <= 0.5x)", "fastserve trace, load 1")] is False
    assert rows[("fastserve mean JCT / the oracle's", "fastserve trace, load 1")] is False   # 7 / 4
    assert rows[("fastserve median ITL / orca's", "fastserve trace, load 1")] is False
    assert rows[("fastserve mean JCT / orca's (oracle gains nothing)", "orca trace, load 0.5")] is True
    assert rows[("orca throughput / request-level's at equal median normalized latency (=)",
                 "orca trace, request-level at load 0.5")] is True
    assert rows[("fastserve iteration / orca's at equal batch composition", "orca trace, all loads")] is None


def test_every_policy_takes_every_place_in_the_order_of_a_trace():
    # the request-level baseline skips the FastServe trace: rotating all four and then skipping it put
    # orca first in both rounds of a 2-round scorecard, so a machine drifting within a round favoured orca
    policies = ["request", "orca", "fastserve", "srpt", CONTROL]
    for trace, runs in (("fastserve", policies[1:]), ("orca", policies)):
        orders = [round_order(policies, trace, rnd) for rnd in range(len(runs))]
        assert all(sorted(o) == sorted(runs) for o in orders)
        for place in range(len(runs)):
            assert sorted(o[place] for o in orders) == sorted(runs)


def test_capacity_at_full_batch_from_the_iterations_compute():
    # ms = 30 + 2 x decodes + 1.5 x prompt tokens, 2 ms between iterations: at 32 decodes a token costs
    # (30 + 2 + 64) / 32 = 3 ms, a prompt token 1.5 ms; a request of 40 prompt and 30 output tokens 150 ms
    rows = [[d, p, 30 + 2 * d + 1.5 * p] for d in (1, 4, 16, 32) for p in (0, 64, 224)]
    assert full_batch_capacity(rows, (40, 30), 32, gap_ms=2.0) == pytest.approx(1000 / 150)
    with pytest.raises(ValueError):
        full_batch_capacity([[8, 0, 40.0]] * 5, (40, 30), 32)     # one composition: nothing to fit
    assert mean_lengths("orca") == (272.0, 64.5)
    prompt, output = mean_lengths("fastserve")      # Zipf: the short lengths dominate
    assert 8 < prompt < 196 and 1 < output < 200


def test_the_noise_floor_is_judged_from_the_a_a_pair():
    agg = {"fastserve": {"1": {"orca": {"jct_mean_s": 1.0}, CONTROL: {"jct_mean_s": 0.8, "jct_mean_s/orca": 0.8}}}}
    row, = (r for r in judge(agg, {}) if r["what"].startswith("noise floor"))
    assert row["value"] == pytest.approx(1.25) and row["met"] is False


def test_no_two_runs_of_a_server_share_a_prompt():
    # capped at 80 requests, loads 1 and 1.5 of one round drew the same requests: the second run of
    # every server took their prompts from its prefix cache
    loads = [0.25, 1.0, 1.5]
    specs = [trace_spec("fastserve", load, 6.0, rnd, loads, 15.0, 20, 80, 0) for rnd in range(2) for load in loads]
    assert [s.num_requests for s in specs] == [22, 80, 80] * 2
    heads = [tuple(r.prompt_token_ids[:16]) for s in specs for r in make_trace(s, range(100_000))]
    assert len(set(heads)) == len(heads)


def test_a_label_names_its_servers_policy_and_a_variants_settings() -> None:
    assert server_of("fastserve") == {"scheduler.policy": "fastserve"}
    assert server_of(CONTROL) == {"scheduler.policy": "orca"}
    assert server_of("fastserve-defer") == {"scheduler.policy": "fastserve", "fastserve.kv_policy": "defer"}
