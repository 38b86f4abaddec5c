#!/usr/bin/env python3
"""Figures from tools/bench.py result files.

    python tools/plot.py RESULTS.json... --out DIR

Writes, for each trace kind found in the files:

  fig10_<trace>.png          ORCA Fig. 10 style: median normalized latency (JCT / generated tokens,
                             ms/token) vs throughput (tok/s); one line per (policy, max_bs) and any
                             other setting that differs between files; points are arrival rates.
  fig9_rate_<trace>.png      FastServe Fig. 9 style: mean JCT (top) and p99 JCT (bottom) vs arrival
                             rate; one line per policy (and other differing settings), one panel
                             per CV (fastserve trace).
  fig9_zipf_<trace>.png      the same vs Zipf θ, one panel per (CV, rate), when the files vary θ.
  summary.csv                one row per file: its settings and the main metrics.
  equal_latency.csv          ORCA's headline: for each `request` point and each `orca` max_bs, the
                             throughput orca reaches at the same median normalized latency,
                             interpolated along its curve, and the ratio of the two.

Files are grouped by their "config" block; files whose runs all failed (n_ok = 0) are skipped.
The figures and tables are orca_mq/bench/sweep_plots.py's.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from orca_mq.bench.result_files import Run, load
from orca_mq.bench.sweep_plots import equal_latency, fig9, fig10, write_csv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="RESULTS.json")
    p.add_argument("--out", required=True, metavar="DIR")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = load(args.files)
    if not runs:
        print("plot: no usable result files", file=sys.stderr)
        return 1
    written = [write_csv(runs, out)]
    by_trace: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_trace[r.trace].append(r)
    for trace, rs in sorted(by_trace.items()):
        written.append(fig10(rs, trace, out))
        if trace == "orca":
            written.append(equal_latency(rs, out))
        written.append(fig9(rs, trace, out, "rate"))
        if trace == "fastserve":
            written.append(fig9(rs, trace, out, "zipf"))
    for path in written:
        if path is not None:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
