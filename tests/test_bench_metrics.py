"""Serving metrics on hand-made request records, against values computed by hand.

Percentiles are numpy's default linear interpolation: for sorted x[0..n-1], p -> r = p/100·(n-1),
value x[floor r] + (r - floor r)·(x[floor r + 1] - x[floor r]).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orca_mq.bench.metrics import format_table, is_ok, percentile, summarize


def rec(index, arrival, first, finish, gen, times, max_tokens, prompt, reason="length", error=None):
    return {
        "index": index, "request_id": f"r{index}", "scheduled_s": arrival, "arrival_s": arrival,
        "first_token_s": first, "finish_s": finish, "prompt_tokens": prompt, "max_tokens": max_tokens,
        "generated_tokens": gen, "finish_reason": reason, "error": error, "metrics": None, "token_times_s": times,
    }


RECORDS = [
    # A: JCT 3, TTFT 1, TPOT (3-1)/2 = 1, ITL [1, 1], normalized 3/3 = 1
    rec(0, 0.0, 1.0, 3.0, 3, [1.0, 2.0, 3.0], max_tokens=3, prompt=10),
    # B: JCT 1, TTFT 0.5, no TPOT (1 token), no ITL, normalized 1; generated 1 of max_tokens 2
    rec(1, 1.0, 1.5, 2.0, 1, [1.5], max_tokens=2, prompt=20, reason="stop"),
    # C: JCT 4, TTFT 0.5, TPOT 3.5/4 = 0.875, ITL [0.5, 0, 2, 1] (two tokens in one event), normalized 0.8
    rec(2, 2.0, 2.5, 6.0, 5, [2.5, 3.0, 3.0, 5.0, 6.0], max_tokens=5, prompt=30),
    # D: an error: counted, excluded from latencies
    rec(3, 3.0, None, 3.5, 0, [], max_tokens=4, prompt=40, reason=None, error="boom"),
]


def test_counts_and_throughput():
    s = summarize(RECORDS)
    assert (s["n_requests"], s["n_ok"], s["n_errors"], s["n_len_mismatch"]) == (4, 3, 1, 1)
    assert s["total_prompt_tokens"] == 100 and s["total_generated_tokens"] == 9
    assert s["makespan_s"] == pytest.approx(6.0)        # last finish 6.0 - first arrival 0.0
    assert s["throughput_tok_s"] == pytest.approx(1.5)  # 9 tokens / 6 s
    assert s["throughput_req_s"] == pytest.approx(0.5)  # 3 ok requests / 6 s
    assert s["error_kinds"] == {"boom": 1}


def test_jct():
    s = summarize(RECORDS)  # JCT sorted [1, 3, 4]
    assert s["jct_mean_s"] == pytest.approx(8 / 3)
    assert s["jct_p50_s"] == pytest.approx(3.0)
    assert s["jct_p90_s"] == pytest.approx(3.8)   # r = 1.8 -> 3 + 0.8·(4 - 3)
    assert s["jct_p99_s"] == pytest.approx(3.98)  # r = 1.98


def test_ttft():
    s = summarize(RECORDS)  # TTFT sorted [0.5, 0.5, 1.0]
    assert s["ttft_mean_s"] == pytest.approx(2 / 3)
    assert s["ttft_p50_s"] == pytest.approx(0.5)
    assert s["ttft_p99_s"] == pytest.approx(0.99)  # r = 1.98 -> 0.5 + 0.98·0.5


def test_tpot():
    s = summarize(RECORDS)  # TPOT of A and C only: [0.875, 1.0]
    assert s["tpot_mean_s"] == pytest.approx(0.9375)
    assert s["tpot_p50_s"] == pytest.approx(0.9375)
    assert s["tpot_p99_s"] == pytest.approx(0.99875)  # r = 0.99 -> 0.875 + 0.99·0.125


def test_itl():
    s = summarize(RECORDS)  # pooled gaps sorted [0, 0.5, 1, 1, 1, 2]
    assert s["itl_mean_s"] == pytest.approx(5.5 / 6)
    assert s["itl_p50_s"] == pytest.approx(1.0)   # r = 2.5 -> between 1 and 1
    assert s["itl_p99_s"] == pytest.approx(1.95)  # r = 4.95 -> 1 + 0.95·(2 - 1)


def test_normalized_latency():
    s = summarize(RECORDS)  # JCT / generated: A 1.0, B 1.0, C 0.8
    assert s["norm_latency_p50_s"] == pytest.approx(1.0)
    assert s["norm_latency_mean_s"] == pytest.approx(2.8 / 3)


def test_not_ok_records():
    assert is_ok(RECORDS[0]) and not is_ok(RECORDS[3])
    aborted = rec(9, 0.0, 0.1, 0.2, 1, [0.1], max_tokens=5, prompt=3, reason="abort")
    assert not is_ok(aborted)
    s = summarize([aborted])
    assert (s["n_ok"], s["n_errors"]) == (0, 1)
    assert s["jct_p50_s"] is None and s["throughput_req_s"] == 0.0
    assert s["throughput_tok_s"] == pytest.approx(5.0)  # its token still counts: 1 / 0.2 s
    assert s["error_kinds"] == {"finish_reason=abort": 1}


def test_empty():
    s = summarize([])
    assert s["n_requests"] == 0 and s["makespan_s"] is None and s["throughput_tok_s"] is None
    assert s["jct_p50_s"] is None and s["itl_p99_s"] is None
    format_table(s)  # renders without numbers


def test_percentile_is_numpy_linear():
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 25) == pytest.approx(1.75)  # r = 0.75
    assert percentile([7], 99) == 7 and percentile([], 50) is None


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60), st.floats(0, 100))
def test_the_one_percentile_equals_numpys(values, p):
    """orca_mq.percentile (pure Python: the stats replies and the simulator use it too) is numpy's linear."""
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-9, abs=1e-6)


def test_required_keys_and_table():
    s = summarize(RECORDS)
    for key in ("throughput_tok_s", "throughput_req_s", "jct_mean_s", "jct_p50_s", "jct_p99_s", "ttft_p50_s",
                "ttft_p99_s", "tpot_p50_s", "itl_p50_s", "itl_p99_s", "norm_latency_p50_s", "makespan_s",
                "n_requests", "n_errors"):
        assert key in s
    table = format_table(s)
    assert "JCT" in table and "3000.0" in table  # p50 JCT in ms


def test_orca_throughput_at_equal_latency():
    """tools/plot.py's ORCA headline: orca's throughput interpolated at the baseline's latency."""
    import math
    from pathlib import Path

    from orca_mq.bench.result_files import Run
    from orca_mq.bench.sweep_plots import orca_throughput_at

    def run(latency_s: float, tok_s: float) -> Run:
        return Run(Path("x.json"), {"config": {"rate": 1.0, "trace": "orca"},
                                    "summary": {"norm_latency_p50_s": latency_s, "throughput_tok_s": tok_s}})

    orca = [run(0.2, 10.0), run(0.4, 30.0), run(1.0, 40.0)]
    value, how = orca_throughput_at(orca, 0.3)                 # halfway between the first two points
    assert math.isclose(value, 20.0) and how == "="
    assert orca_throughput_at(orca, 1.0) == (40.0, "=")
    assert orca_throughput_at(orca, 2.0) == (40.0, ">=")       # slower than any orca point: a lower bound
    value, how = orca_throughput_at(orca, 0.1)
    assert math.isnan(value) and how == "n/a"


def test_equal_latency_table_compares_each_request_point_with_every_orca_curve(tmp_path):
    import csv
    from pathlib import Path

    from orca_mq.bench.result_files import Run
    from orca_mq.bench.sweep_plots import equal_latency

    def run(policy: str, bs: int, latency_s: float, tok_s: float) -> Run:
        return Run(Path("x.json"), {"config": {"rate": 1.0, "trace": "orca", "policy": policy, "max_bs": bs},
                                    "summary": {"norm_latency_p50_s": latency_s, "throughput_tok_s": tok_s}})

    runs = [run("orca", 4, 0.2, 10.0), run("orca", 4, 0.4, 20.0), run("orca", 16, 0.2, 10.0), run("orca", 16, 0.6, 50.0),
            run("request", 1, 0.3, 5.0)]
    with open(equal_latency(runs, tmp_path)) as f:
        rows = list(csv.DictReader(f))
    assert [(r["request_max_bs"], r["orca_max_bs"], r["orca_tok_s_at_that_latency"], r["orca_over_request"]) for r in rows] == [
        ("1", "4", "15.00", "3.00"), ("1", "16", "20.00", "4.00")]
