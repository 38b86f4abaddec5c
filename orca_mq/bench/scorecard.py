"""The scheduling scorecard's arithmetic (tools/scorecard.py runs it): every policy at loads relative to
the system's measured capacity, on an ORCA-shaped and a FastServe-shaped trace, summarized as medians
over interleaved rounds, and issue 21's targets judged from those medians.

A load is a fraction of the capacity measured with a burst of the same trace shape: the requests per
second the engine completes when every iteration is full (`full_batch_capacity`, from the burst's
own iterations). The burst's completion rate itself is not the capacity on a heavy-tailed trace:
its end is the longest job decoding alone, so it reads the FastServe trace's capacity ~40% low and
"load 1.5" would not be an overload. Ratios to `orca` are taken round by round, then the median,
so that a machine whose speed drifts between rounds moves both sides of each ratio alike; the
policies' order rotates round by round (`round_order`). Every (round, load) draws its own trace
(`trace_spec`): a server that ran the same prompts before would take them from its prefix cache.
`orca-again`, a second orca server run in the same round, is the noise floor of those ratios (an
A/A pair). `srpt` is an oracle (it knows output lengths): it bounds what a policy can gain and is
never a contender.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from orca_mq.bench.trace import TraceSpec, zipf_pmf

TRACES: dict[str, dict[str, Any]] = {
    # ORCA §6.2: Poisson arrivals, input ~ U(32, 512), output ~ U(1, 128), generation forced
    "orca": {"kind": "orca", "cv": 1.0, "zipf": 1.0, "input_len": (32, 512), "output_len": (1, 128)},
    # FastServe §6's shape: Gamma arrivals (CV 4), Zipf lengths (θ 1.2): bursty, many short jobs, a long tail
    "fastserve": {"kind": "fastserve", "cv": 4.0, "zipf": 1.2, "input_len": (8, 384), "output_len": (1, 400)},
}
METRICS = ("jct_mean_s", "jct_p50_s", "jct_p99_s", "ttft_mean_s", "ttft_p50_s", "itl_p50_s", "throughput_tok_s",
           "throughput_req_s", "norm_latency_p50_s", "makespan_s",
           "iterations", "decodes_mean", "prompt_tokens_mean", "compute_ms_mean")   # the last: `composition`
GAINS_NOTHING = 0.9       # the oracle's mean JCT at or above this fraction of orca's: nothing to gain
ORACLE_GAINS = 0.5        # at or below it: the oracle halves orca's mean JCT
SHAPE_BUCKET = (4, 32)    # decodes, prompt tokens: iterations in one bucket have one batch composition
CONTROL = "orca-again"    # a second orca server: its ratio to orca's is the noise floor of every ratio (A/A)
# labels that run a policy with other settings, each on a server of its own
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    CONTROL: ("orca", {}),
    **{f"fastserve-{kv}": ("fastserve", {"fastserve.kv_policy": kv}) for kv in ("proactive", "defer", "reactive")}}


def server_of(label: str) -> dict[str, str]:
    """The settings of the server a scorecard label runs on: its scheduler policy, and a variant's."""
    policy, sets = VARIANTS.get(label, (label, {}))
    return {"scheduler.policy": policy, **sets}


def runs_trace(policy: str, trace: str) -> bool:
    """The request-level baseline runs the ORCA trace only (the paper compares it there)."""
    return policy != "request" or trace == "orca"


def round_order(policies: Sequence[str], trace: str, rnd: int) -> list[str]:
    """The policies that run `trace`, rotated by the round: over as many rounds as there are of them,
    each runs once in every position, so a machine that drifts within a round favours none."""
    runs = [p for p in policies if runs_trace(p, trace)]
    k = rnd % len(runs) if runs else 0
    return runs[k:] + runs[:k]


def trace_spec(trace: str, load: float, capacity: float, rnd: int, loads: Sequence[float], duration: float,
               min_requests: int, max_requests: int, seed: int) -> TraceSpec:
    """The trace of one round at one of its `loads`: `load x capacity x duration` requests (within the
    bounds) of the trace's shape, each (round, load) its own draw, seeded after the capacity burst's
    `seed`: no two runs of a server share a prompt (capped at --max-requests, two loads would
    otherwise draw the same requests, and the second run take their prompts from the prefix cache).
    tools/simulate.py --scorecard replays the same ones."""
    shape, rate = TRACES[trace], load * capacity
    n = max(min_requests, min(max_requests, round(rate * duration)))
    return TraceSpec(shape["kind"], n, rate, shape["cv"], shape["zipf"], shape["input_len"], shape["output_len"],
                     seed + 1 + rnd * len(loads) + list(loads).index(load))


def mean_lengths(trace: str) -> tuple[float, float]:
    """The expected (prompt, output) tokens of a request of the trace's shape (its laws, not a sample:
    a few dozen Zipf draws have a mean that varies by half)."""
    shape = TRACES[trace]
    if shape["kind"] == "orca":
        return sum(shape["input_len"]) / 2, sum(shape["output_len"]) / 2
    return tuple(float(np.arange(lo, hi + 1) @ zipf_pmf(lo, hi, shape["zipf"]))  # type: ignore[return-value]
                 for lo, hi in (shape["input_len"], shape["output_len"]))


def full_batch_capacity(rows: Sequence[Sequence[float]], lengths: tuple[float, float], max_bs: int,
                        gap_ms: float = 0.0) -> float:
    """Requests per second the engine completes when every iteration carries `max_bs` decodes: the
    iterations' compute ([decodes, prompt tokens, ms], a worker's record) fitted as
    ms = a + b x decodes + c x prompt tokens, plus `gap_ms` between iterations (scheduler and
    messaging); a request of `lengths` (prompt, output) tokens then costs c x prompt +
    (a + gap + b x max_bs) / max_bs x output engine-milliseconds, and the capacity is one over that."""
    x = np.asarray(rows, dtype=np.float64).reshape(-1, 3)
    if len(x) < 3 or np.ptp(x[:, 0]) == 0 or np.ptp(x[:, 1]) == 0:
        raise ValueError("full_batch_capacity: need iterations of several batch sizes and prompt sizes")
    (a, b, c), *_ = np.linalg.lstsq(np.c_[np.ones(len(x)), x[:, 0], x[:, 1]], x[:, 2], rcond=None)
    prompt, output = lengths
    return 1000.0 / (max(c, 0.0) * prompt + (max(a, 0.0) + gap_ms + max(b, 0.0) * max_bs) / max_bs * output)


def composition(rows: Sequence[Sequence[float]]) -> dict[str, float | None]:
    """What a run's iterations were ([decodes, prompt tokens, ms] each): how many, their mean decodes,
    prompt tokens and compute, so a ratio of JCTs can be told apart into what was scheduled and how
    fast it ran."""
    if not rows:
        return {"iterations": 0, "decodes_mean": None, "prompt_tokens_mean": None, "compute_ms_mean": None}
    return {"iterations": len(rows), "decodes_mean": statistics.mean(d for d, _, _ in rows),
            "prompt_tokens_mean": statistics.mean(p for _, p, _ in rows), "compute_ms_mean": statistics.mean(ms for *_, ms in rows)}


def throughput_at(points: Iterable[tuple[float, float]], latency: float) -> tuple[float, str]:
    """A curve's throughput at a latency, linear along its (latency, throughput) points: (value, "=");
    beyond its slowest point its highest throughput is a lower bound (value, ">="); below its fastest
    point it is unknown (nan, "n/a")."""
    pts = sorted(points)
    if latency > pts[-1][0]:
        return max(t for _, t in pts), ">="
    if latency < pts[0][0]:
        return math.nan, "n/a"
    for (l0, t0), (l1, t1) in zip(pts, pts[1:] or pts):
        if l0 <= latency <= l1:
            return t0 if l1 == l0 else t0 + (t1 - t0) * (latency - l0) / (l1 - l0), "="
    raise AssertionError("unreachable: the latency lies within the points")


def shape_cost_ratio(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], min_samples: int = 3) -> dict[str, Any]:
    """What one batch composition costs under `a` relative to `b`: iterations ([decodes, prompt tokens,
    compute ms], a worker's record) are bucketed by composition; the result is the median, over the
    buckets both have at least `min_samples` of, of the ratio of their median compute times, each
    bucket weighted by the fewer of its two counts."""
    def buckets(rows: Sequence[Sequence[float]]) -> dict[tuple[int, int], list[float]]:
        out: dict[tuple[int, int], list[float]] = defaultdict(list)
        for d, p, ms in rows:
            out[(int(d) // SHAPE_BUCKET[0], int(p) // SHAPE_BUCKET[1])].append(ms)
        return out

    ba, bb = buckets(a), buckets(b)
    weighted: list[float] = []
    for key in ba.keys() & bb.keys():
        n = min(len(ba[key]), len(bb[key]))
        if n >= min_samples:
            weighted += [statistics.median(ba[key]) / statistics.median(bb[key])] * n
    return {"ratio": statistics.median(weighted) if weighted else None, "iterations": len(weighted),
            "buckets": len(ba.keys() & bb.keys())}


def _median(values: Iterable[float | None]) -> float | None:
    vs = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vs) if vs else None


def aggregate(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Runs ({trace, load, round, policy, summary}) -> per trace, load and policy: the median of each
    metric over rounds, and of its ratio to orca's in the same round."""
    by_point: dict[tuple[str, float, int], dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for r in runs:
        by_point[(r["trace"], float(r["load"]), int(r["round"]))][r["policy"]] = r["summary"]
    cells: dict[tuple[str, float, str], dict[str, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    for (trace, load, _), policies in by_point.items():
        base = policies.get("orca")
        for policy, s in policies.items():
            cell = cells[(trace, load, policy)]
            for m in METRICS:
                cell[m].append(s.get(m))
                if base and s.get(m) is not None and base.get(m):
                    cell[m + "/orca"].append(s[m] / base[m])
    out: dict[str, Any] = {}
    for (trace, load, policy), cell in sorted(cells.items()):
        out.setdefault(trace, {}).setdefault(f"{load:g}", {})[policy] = {k: _median(v) for k, v in cell.items()} | {
            "rounds": len(cell["jct_mean_s"])}
    return out


def judge(agg: Mapping[str, Any], shape_ratios: Mapping[str, float | None]) -> list[dict[str, Any]]:
    """Issue 21's targets against the medians: one row per check (what, where, value, bound, met)."""
    rows: list[dict[str, Any]] = []

    def check(what: str, where: str, value: float | None, bound: float, higher_is_better: bool = False) -> None:
        met = None if value is None else (value >= bound if higher_is_better else value <= bound)
        rows.append({"what": what, "where": where, "value": value, "bound": bound, "met": met})

    for trace, loads in agg.items():
        for load, pol in loads.items():
            fs, oracle = pol.get("fastserve"), pol.get("srpt")
            where = f"{trace} trace, load {load}"
            if CONTROL in pol:   # two runs of one server: a ratio this far from 1 is the machine, not a policy
                aa = pol[CONTROL].get("jct_mean_s/orca")
                check("noise floor: orca again vs orca mean JCT, max(x, 1/x) (A/A)", where, aa and max(aa, 1 / aa), 1.05)
            if fs:
                check("fastserve median ITL / orca's", where, fs.get("itl_p50_s/orca"), 1.1)
            if not (fs and oracle and oracle.get("jct_mean_s/orca") is not None):
                continue
            gain = oracle["jct_mean_s/orca"]
            if gain >= GAINS_NOTHING:
                check("fastserve mean JCT / orca's (oracle gains nothing)", where, fs.get("jct_mean_s/orca"), 1.05)
            if gain <= ORACLE_GAINS:
                check("fastserve mean JCT / orca's (oracle <= 0.5x)", where, fs.get("jct_mean_s/orca"), 0.6)
                ratio = None if fs.get("jct_mean_s") is None else fs["jct_mean_s"] / oracle["jct_mean_s"]
                check("fastserve mean JCT / the oracle's", where, ratio, 1.4)
                check("fastserve p99 JCT / orca's", where, fs.get("jct_p99_s/orca"), 1.2)
    orca_trace = agg.get("orca", {})
    orca_curve = [(p["orca"]["norm_latency_p50_s"], p["orca"]["throughput_tok_s"]) for p in orca_trace.values()
                  if p.get("orca") and p["orca"].get("norm_latency_p50_s") and p["orca"].get("throughput_tok_s")]
    for load, pol in orca_trace.items():
        req = pol.get("request")
        if orca_curve and req and req.get("norm_latency_p50_s") and req.get("throughput_tok_s"):
            thr, how = throughput_at(orca_curve, req["norm_latency_p50_s"])
            value = None if how == "n/a" else thr / req["throughput_tok_s"]
            check(f"orca throughput / request-level's at equal median normalized latency ({how})",
                  f"orca trace, request-level at load {load}", value, 3.0, higher_is_better=True)
    for trace, ratio in shape_ratios.items():
        check("fastserve iteration / orca's at equal batch composition", f"{trace} trace, all loads", ratio, 1.05)
    return rows
