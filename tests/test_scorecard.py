"""The scheduling scorecard's arithmetic (orca_mq/bench/scorecard.py): medians of per-round ratios,
throughput at a latency along a curve, one composition's cost, and issue 21's targets judged."""
import math

import pytest

from orca_mq.bench.scorecard import aggregate, judge, shape_cost_ratio, throughput_at


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
