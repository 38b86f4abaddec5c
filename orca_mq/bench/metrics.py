"""Serving metrics from per-request records (pure computation, no I/O).

A record is a dict (the same shape the replayer writes into the result file):

    index             int    position in the trace
    request_id        str | None
    scheduled_s       float  arrival time the trace asked for (s after the run start)
    arrival_s         float  time the request was actually sent (s after the run start)
    first_token_s     float | None  time the first generated token was received
    finish_s          float | None  time the final event (finished=True) or the error was received
    token_times_s     list[float]   receive time of every generated token (tokens that came in
                                    one event share its time); may be absent
    prompt_tokens     int | None  the server's count when its final message reports it, else the trace's
    cached_tokens     int | None  of those, taken from the server's prefix cache (None: not reported)
    max_tokens        int
    generated_tokens  int
    finish_reason     "stop" | "length" | "abort" | "error" | None
    error             str | None
    metrics           dict | None   server-side per-request metrics from the final event

A request is *ok* when it has no error, finished with reason "stop" or "length", and has a
finish time. Latency statistics use ok requests only; ``n_errors`` counts the others.

Definitions (all times in seconds):

    makespan      max(finish_s of any record) - min(arrival_s of any record)
    throughput    generated tokens of all records / makespan (tok/s); ok requests / makespan (req/s)
    JCT (E2E)     finish_s - arrival_s
    TTFT          first_token_s - arrival_s                          (ok, >= 1 token)
    TPOT          (finish_s - first_token_s) / (generated - 1)       (ok, >= 2 tokens)
    ITL           gaps between consecutive token_times_s of a request, pooled over ok requests
                  (tokens delivered in one event contribute a gap of 0)
    normalized    JCT / generated tokens, per request (ORCA's "latency normalized by the number
    latency       of generated tokens"; ok, >= 1 token)

Each statistic is reported as mean, p50, p90 and p99 (keys ``<metric>_<stat>_s``). Percentiles are
numpy's default ``np.percentile(..., method="linear")``: the p-th percentile of sorted x[0..n-1] is
x[f] + (x[f+1] - x[f])·(r - f) with r = p/100·(n-1), f = floor(r). A statistic over an empty set is
None.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from orca_mq.percentile import percentile

OK_REASONS = ("stop", "length")
STATS = (("mean", None), ("p50", 50.0), ("p90", 90.0), ("p99", 99.0))
LATENCY_METRICS = ("jct", "ttft", "tpot", "itl", "norm_latency")


def is_ok(rec: Mapping[str, Any]) -> bool:
    return rec.get("error") is None and rec.get("finish_reason") in OK_REASONS and rec.get("finish_s") is not None


def _stats(name: str, values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for stat, p in STATS:
        if p is None:
            out[f"{name}_{stat}_s"] = float(np.mean(values)) if len(values) else None
        else:
            out[f"{name}_{stat}_s"] = percentile(values, p)
    return out


def per_request_latencies(rec: Mapping[str, Any]) -> dict[str, Any]:
    """JCT, TTFT, TPOT, normalized latency and ITL gaps of one ok record (None where undefined)."""
    arrival, first, finish = rec["arrival_s"], rec.get("first_token_s"), rec["finish_s"]
    gen = int(rec.get("generated_tokens") or 0)
    jct = finish - arrival
    times = rec.get("token_times_s") or []
    return {
        "jct": jct,
        "ttft": first - arrival if first is not None and gen >= 1 else None,
        "tpot": (finish - first) / (gen - 1) if first is not None and gen >= 2 else None,
        "norm_latency": jct / gen if gen >= 1 else None,
        "itl": [b - a for a, b in zip(times, times[1:])],
    }


GOODPUT_METRICS = {"ttft": "ttft", "tpot": "tpot", "e2el": "jct"}   # vllm bench serve's SLO names


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] (milliseconds, as `vllm bench serve --goodput`) -> {"ttft": 0.5, "tpot": 0.05}."""
    slos: dict[str, float] = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in GOODPUT_METRICS or not ms:
            raise ValueError(f"goodput SLO {item!r}: expected one of {'|'.join(GOODPUT_METRICS)}:MILLISECONDS")
        slos[name] = float(ms) / 1000.0
    return slos


def meets_slos(rec: Mapping[str, Any], slos: Mapping[str, float]) -> bool:
    """An ok request whose every given SLO holds (a metric it does not have, e.g. TPOT of one token, holds)."""
    if not is_ok(rec):
        return False
    lat = per_request_latencies(rec)
    return all(lat[GOODPUT_METRICS[k]] is None or lat[GOODPUT_METRICS[k]] <= v for k, v in slos.items())


def summarize(records: Iterable[Mapping[str, Any]], slos: Mapping[str, float] | None = None) -> dict[str, Any]:
    recs = list(records)
    ok = [r for r in recs if is_ok(r)]
    finishes = [r["finish_s"] for r in recs if r.get("finish_s") is not None]
    arrivals = [r["arrival_s"] for r in recs if r.get("arrival_s") is not None]
    makespan = (max(finishes) - min(arrivals)) if finishes and arrivals else None
    gen_total = int(sum(int(r.get("generated_tokens") or 0) for r in recs))

    series: dict[str, list[float]] = {m: [] for m in LATENCY_METRICS}
    for r in ok:
        lat = per_request_latencies(r)
        for m in ("jct", "ttft", "tpot", "norm_latency"):
            if lat[m] is not None:
                series[m].append(lat[m])
        series["itl"].extend(lat["itl"])

    summary: dict[str, Any] = {
        "n_requests": len(recs),
        "n_ok": len(ok),
        "n_errors": len(recs) - len(ok),
        "n_len_mismatch": sum(1 for r in ok if r.get("max_tokens") is not None
                              and int(r.get("generated_tokens") or 0) != int(r["max_tokens"])),
        "total_prompt_tokens": int(sum(int(r.get("prompt_tokens") or 0) for r in recs)),
        "total_cached_tokens": (int(sum(int(r.get("cached_tokens") or 0) for r in recs))
                                if any(r.get("cached_tokens") is not None for r in recs) else None),
        "total_generated_tokens": gen_total,
        "makespan_s": makespan,
        "throughput_tok_s": gen_total / makespan if makespan else None,
        "throughput_req_s": len(ok) / makespan if makespan else None,
        "throughput_total_tok_s": (gen_total + sum(int(r.get("prompt_tokens") or 0) for r in ok)) / makespan
        if makespan else None,
        "goodput_slos_s": dict(slos or {}),
        "goodput_req_s": sum(meets_slos(r, slos) for r in ok) / makespan if slos and makespan else None,
    }
    for m in LATENCY_METRICS:
        summary.update(_stats(m, series[m]))
    errors: dict[str, int] = {}
    for r in recs:
        if not is_ok(r):
            key = str(r.get("error") or f"finish_reason={r.get('finish_reason')}")[:200]
            errors[key] = errors.get(key, 0) + 1
    summary["error_kinds"] = errors
    return summary


# ---------------------------------------------------------------- display

_TABLE_ROWS = (
    ("requests (ok / total)", lambda s: f"{s['n_ok']} / {s['n_requests']}"),
    ("errors", lambda s: str(s["n_errors"])),
    ("gen != max_tokens", lambda s: str(s["n_len_mismatch"])),
    ("makespan", lambda s: _fmt(s["makespan_s"], "s")),
    ("throughput", lambda s: f"{_fmt(s['throughput_tok_s'], 'tok/s')}   {_fmt(s['throughput_req_s'], 'req/s')}"),
    ("total tok/s (prompt + gen)", lambda s: _fmt(s.get("throughput_total_tok_s"), "tok/s")),
    ("goodput", lambda s: _fmt(s.get("goodput_req_s"), "req/s") + "".join(
        f"  {k}<={v * 1000:g}ms" for k, v in (s.get("goodput_slos_s") or {}).items())),
    ("prompt / generated tokens", lambda s: f"{s['total_prompt_tokens']} / {s['total_generated_tokens']}"),
    ("cached prompt tokens", lambda s: "-" if s.get("total_cached_tokens") is None else str(s["total_cached_tokens"])),
)


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.4g} {unit}".rstrip()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_table(summary: Mapping[str, Any]) -> str:
    lines = [f"{name:<28}{fn(summary)}" for name, fn in _TABLE_ROWS]
    lines.append("")
    lines.append(f"{'latency (ms)':<28}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    labels = {"jct": "JCT (E2E)", "ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "norm_latency": "JCT / gen token"}
    for m in LATENCY_METRICS:
        cells = "".join(f"{_ms(summary.get(f'{m}_{st}_s')):>10}" for st, _ in STATS)
        lines.append(f"{labels[m]:<28}{cells}")
    for kind, count in (summary.get("error_kinds") or {}).items():
        lines.append(f"error x{count}: {kind}")
    return "\n".join(lines)
