"""Sweep serving knobs (max_bs, the chunked-prefill token budget, dtype, ...) on one trace, the
configurations interleaved round by round (a shared machine's load swings hit all of them alike).

Each point is one `tools/bench.py` run (a real server launched and stopped). Prints medians over
the rounds of makespan, mean JCT, p99 TPOT and p99 TTFT, and writes every run's summary to JSON.

    python tools/sweep_serving.py --rate inf --rounds 2 --out results/sweep_burst.json \\
        --point bs16:scheduler.max_bs=16 --point bs32_t512:scheduler.max_bs=32,scheduler.max_num_batched_tokens=512
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from orca_mq.server.process import ROOT

METRICS = (("makespan_s", "makespan s"), ("jct_mean_s", "mean JCT s"), ("tpot_p99_s", "p99 TPOT s"), ("ttft_p99_s", "p99 TTFT s"))


def run_point(sets: list[str], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--policy", args.policy, "--trace", "orca",
           "--num-requests", str(args.num_requests), "--rate", args.rate, "--input-len", args.input_len,
           "--output-len", args.output_len, "--seed", str(args.seed), "--no-progress", "--out", str(out)]
    for s in [*args.set, *sets]:
        key, _, value = s.partition("=")
        cmd += ["--max-bs", value] if key == "scheduler.max_bs" else ["--set", s]   # bench.py owns that key
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.timeout)
    return json.loads(out.read_text())["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--point", action="append", required=True, metavar="NAME:key=value,...")
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value", help="applies to every point")
    ap.add_argument("--policy", default="orca")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rate", default="inf", help="req/s; inf = a burst at t = 0")
    ap.add_argument("--input-len", default="32:512")
    ap.add_argument("--output-len", default="1:128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    points = {name: sets.split(",") if sets else [] for name, _, sets in (p.partition(":") for p in args.point)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in points}
    with tempfile.TemporaryDirectory(prefix="orca_mq_sweep_") as tmp:
        for r in range(args.rounds):
            for name, sets in points.items():
                summary = run_point(sets, args, Path(tmp) / f"{name}_{r}.json")
                runs[name].append(summary)
                print(f"round {r + 1} {name}: " + ", ".join(f"{label} {summary.get(key) or 0:.3f}" for key, label in METRICS),
                      file=sys.stderr, flush=True)
    print(f"{'point':16}" + "".join(f"{label:>13}" for _, label in METRICS) + "   (medians)")
    medians = {}
    for name, summaries in runs.items():
        medians[name] = {key: statistics.median(s.get(key) or 0.0 for s in summaries) for key, _ in METRICS}
        print(f"{name:16}" + "".join(f"{medians[name][key]:13.3f}" for key, _ in METRICS))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": sys.argv, "points": points, "medians": medians, "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
