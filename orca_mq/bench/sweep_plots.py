"""Figures and tables across benchmark result files (tools/plot.py is their command line): ORCA's
Fig. 10 (median normalized latency vs throughput), FastServe's Fig. 9 (mean / p99 JCT vs arrival
rate or Zipf θ), a summary CSV, and ORCA's headline at equal latency. The runs are read by
orca_mq/bench/result_files.py; matplotlib is imported by the figures only.
"""
from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from orca_mq.bench.result_files import Run
from orca_mq.bench.scorecard import throughput_at

# settings that may tell two result files apart (besides rate, the x axis of most figures)
SETTINGS = ("policy", "max_bs", "cv", "zipf", "input_len", "output_len", "num_requests", "seed", "set")
CSV_METRICS = ("n_requests", "n_errors", "makespan_s", "throughput_tok_s", "throughput_req_s", "jct_mean_s",
               "jct_p50_s", "jct_p99_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p50_s", "itl_p99_s",
               "norm_latency_p50_s")


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return ""
    if key == "set":
        return "[" + " ".join(v) + "]" if v else "[]"
    if isinstance(v, tuple):
        return ":".join(map(str, v))
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def varying(runs: list[Run], keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if len({repr(r.get(k)) for r in runs}) > 1]


def group(runs: list[Run], keys: list[str]) -> dict[tuple, list[Run]]:
    out: dict[tuple, list[Run]] = defaultdict(list)
    for r in runs:
        out[tuple(r.get(k) for k in keys)].append(r)
    return dict(sorted(out.items(), key=lambda kv: tuple(repr(x) for x in kv[0])))


def label(keys: list[str], values: tuple) -> str:
    if keys[:2] == ["policy", "max_bs"]:
        head = f"{values[0]}({values[1]})"  # the paper's "orca(max_bs)"
        rest = [f"{k}={_fmt(k, v)}" for k, v in zip(keys[2:], values[2:])]
        return ", ".join([head] + rest)
    return ", ".join(f"{k}={_fmt(k, v)}" for k, v in zip(keys, values)) or "all"


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) or rate == 0 else f"{rate:g}"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fig10(runs: list[Run], trace: str, out: Path) -> Path:
    plt = _pyplot()
    keys = ["policy", "max_bs"] + [k for k in varying(runs, SETTINGS) if k not in ("policy", "max_bs", "seed")]
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for values, rs in group(runs, keys).items():
        rs = sorted(rs, key=lambda r: (r.rate if r.rate > 0 else math.inf, r.get("seed") or 0))
        xs = [r.m("throughput_tok_s") for r in rs]
        ys = [r.m("norm_latency_p50_s") * 1000 for r in rs]
        (line,) = ax.plot(xs, ys, marker="o", label=label(keys, values))
        for x, y, r in zip(xs, ys, rs):
            ax.annotate(_rate_text(r.rate), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7,
                        color=line.get_color())
    ax.set_xlabel("throughput (generated tokens/s)")
    ax.set_ylabel("median normalized latency (ms/token)")
    ax.set_title(f"normalized latency vs throughput ({trace} trace; labels = req/s)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = out / f"fig10_{trace}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def fig9(runs: list[Run], trace: str, out: Path, x: str) -> Path | None:
    """Mean / p99 JCT vs x ("rate" or "zipf"); panels per CV (and per rate when x = zipf)."""
    if x == "rate":
        runs = [r for r in runs if 0 < r.rate < math.inf]
        panel_keys = ["cv"] if trace == "fastserve" else []
    else:
        panel_keys = ["cv", "rate"]
    if not runs:
        return None
    plt = _pyplot()
    axis_of = (lambda r: r.rate) if x == "rate" else (lambda r: r.get("zipf"))
    line_keys = [k for k in varying(runs, SETTINGS) if k not in (*panel_keys, x, "seed")]
    if "policy" not in line_keys:
        line_keys.insert(0, "policy")

    def panel_of(r: Run) -> tuple:
        return tuple(r.rate if k == "rate" else r.get(k) for k in panel_keys)

    panels: dict[tuple, list[Run]] = defaultdict(list)
    for r in runs:
        panels[panel_of(r)].append(r)
    if x == "zipf":  # only panels where θ actually varies
        panels = {k: v for k, v in panels.items() if len({r.get("zipf") for r in v}) > 1}
        if not panels:
            return None
    pkeys = sorted(panels, key=lambda t: tuple(float("inf") if v is None else v for v in t))
    fig, axes = plt.subplots(2, len(pkeys), figsize=(4.2 * len(pkeys) + 1, 6.4), squeeze=False, sharex="col")
    for col, pk in enumerate(pkeys):
        for values, rs in group(panels[pk], line_keys).items():
            rs = sorted(rs, key=axis_of)
            xs = [axis_of(r) for r in rs]
            for row, metric in enumerate(("jct_mean_s", "jct_p99_s")):
                axes[row][col].plot(xs, [r.m(metric) for r in rs], marker="o", label=label(line_keys, values))
        title = ", ".join(f"{'rate' if k == 'rate' else k}={_fmt(k, v)}" for k, v in zip(panel_keys, pk))
        axes[0][col].set_title(title or f"{trace} trace")
        axes[1][col].set_xlabel("arrival rate (req/s)" if x == "rate" else "Zipf θ")
        for row in range(2):
            axes[row][col].grid(alpha=0.3)
            axes[row][col].set_ylim(bottom=0)
    axes[0][0].set_ylabel("mean JCT (s)")
    axes[1][0].set_ylabel("p99 JCT (s)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"job completion time vs {'arrival rate' if x == 'rate' else 'Zipf θ'} ({trace} trace)")
    path = out / f"fig9_{x}_{trace}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def write_csv(runs: list[Run], out: Path) -> Path:
    path = out / "summary.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "trace", "rate", *SETTINGS, *CSV_METRICS])
        for r in sorted(runs, key=lambda r: (r.trace, repr(r.get("policy")), repr(r.get("max_bs")), r.rate)):
            w.writerow([r.path.name, r.trace, _rate_text(r.rate), *(_fmt(k, r.get(k)) for k in SETTINGS),
                        *(r.summary.get(k) for k in CSV_METRICS)])
    return path


def orca_throughput_at(orca: list[Run], latency: float) -> tuple[float, str]:
    """orca's throughput at a median normalized latency, along its points (orca_mq/bench/scorecard.py)."""
    return throughput_at(((r.m("norm_latency_p50_s"), r.m("throughput_tok_s")) for r in orca), latency)


def equal_latency(runs: list[Run], out: Path) -> Path | None:
    """Every `request` point against every `orca` curve: the same max_bs, and the others, as the
    ORCA paper compares each system's configurations at one latency (its 36.9x is across them)."""
    rows = []
    curves = group([r for r in runs if r.get("policy") == "orca"], ["max_bs"])
    base = [r for r in runs if r.get("policy") == "request"]
    for r in sorted(base, key=lambda r: (float(r.get("max_bs")), r.rate)):
        lat, thr = r.m("norm_latency_p50_s"), r.m("throughput_tok_s")
        for (bs,), orca in sorted(curves.items(), key=lambda kv: float(kv[0][0])):
            orca_thr, how = orca_throughput_at(orca, lat)
            ratio = "n/a" if how == "n/a" else ("" if how == "=" else how) + f"{orca_thr / thr:.2f}"
            rows.append([r.get("max_bs"), _rate_text(r.rate), f"{lat * 1000:.1f}", f"{thr:.2f}", bs, f"{orca_thr:.2f}", ratio])
    if not rows:
        return None
    path = out / "equal_latency.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["request_max_bs", "request_rate", "norm_latency_p50_ms", "request_tok_s", "orca_max_bs",
                    "orca_tok_s_at_that_latency", "orca_over_request"])
        w.writerows(rows)
    return path
