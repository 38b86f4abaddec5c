#!/usr/bin/env python3
"""Replay a benchmark trace through the served scheduling code on a virtual clock: what each policy,
and the SRPT oracle, could do for JCT on this engine.

    python tools/simulate.py --trace fastserve --rates 2 --cvs 4 --zipf 1.5 --output-len 1:512 \\
        [--policies orca,fastserve,srpt] [--set section.key=value ...] [--profile FILE.json] --out FILE.json
    python tools/simulate.py --scorecard results/scorecard.json [--profile FILE.json] --out FILE.json

The schedulers (orca_mq/bench/simulate.py) are the serving system's own policies, driven through the
same `Scheduler.step()` as the offline `LLM` and the scheduler process, fed the same trace as tools/bench.py (same spec and
seed -> same lengths and arrivals). Only the engine is replaced: an iteration takes the time the
cost model predicts. By default that is this machine's iteration profile (FastServe's start-up
profile: the initiation time of each prompt chunk beyond a batch-1 increment, plus one increment
iteration at the batch's decode size), measured by running the real engine's probes (`--profile`
reuses a saved one; without it the profile is measured and saved next to --out). One pipeline
stage; no swap or messaging cost.

With --scorecard, the very traces a tools/scorecard.py run served (its capacities, loads, rounds and
seeds) are replayed, and each policy's mean JCT relative to orca's in the same round is printed
beside the served one: where they differ, the served system did something the scheduling code alone
does not explain (or the machine's noise did: see the scorecard's orca-again row).

`srpt` is an oracle, not a policy of the system (orca_mq/sched/srpt.py): it knows every request's
output length and runs the least remaining work first, so its mean JCT bounds what any policy that
does not know output lengths (FastServe's MLFQ included) can reach.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from orca_mq.bench.cost_model import gpt3_175b_profile
from orca_mq.bench.simulate import measured_profile, profile_cost, replay_scorecard, run_policy
from orca_mq.bench.trace import DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN, TraceSpec, parse_range
from orca_mq.config import load_config
from orca_mq.sched.profiler import IterationProfile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", choices=("orca", "fastserve"))
    p.add_argument("--scorecard", default=None, help="a tools/scorecard.py JSON: replay its traces, compare its ratios")
    p.add_argument("--policies", default="orca,fastserve,srpt", help="comma list of orca, request, fastserve, srpt")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--rates", default="1", help="comma list of req/s")
    p.add_argument("--cvs", default="1", help="comma list, fastserve trace")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--input-len", type=parse_range, default=DEFAULT_INPUT_LEN)
    p.add_argument("--output-len", type=parse_range, default=DEFAULT_OUTPUT_LEN)
    p.add_argument("--max-bs", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="section.key=value")
    p.add_argument("--profile", default=None, help="IterationProfile JSON (default: measure it now and save it), "
                   "or gpt3-175b: the roofline of GPT-3 175B on 16 A100s (orca_mq/bench/cost_model.py)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sets = [*args.sets] + ([f"scheduler.max_bs={args.max_bs}"] if args.max_bs else [])
    cfg = load_config(None, sets)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.profile == "gpt3-175b":
        profile = gpt3_175b_profile()
    elif args.profile:
        profile = IterationProfile.load(args.profile)
    else:
        profile = measured_profile(sets)
        profile.save(out.with_suffix(".profile.json"))
    if args.scorecard:
        card = replay_scorecard(args.scorecard, cfg, profile)
        print(f"{'trace':>9} {'load':>5} {'n':>4}  mean JCT / orca's in the same round (median of rounds): served | simulated")
        for row in card:
            cells = " ".join(f"{pol} {row['served'][pol]:.3f} | {row['sim'][pol]:.3f}" if pol in row["sim"]
                             else f"{pol} {row['served'][pol]:.3f} | -" for pol in row["served"] if pol != "orca")
            print(f"{row['trace']:>9} {row['load']:>5g} {row['n']:>4}  {cells}")
        out.write_text(json.dumps({"args": vars(args), "profile": profile.to_dict(), "scorecard": card}, indent=2, default=str))
        print(f"wrote {out}")
        return 0
    if args.trace is None:
        p.error("--trace or --scorecard is required")
    policies = args.policies.split(",")
    rows: list[dict[str, Any]] = []
    for cv in map(float, args.cvs.split(",")):
        for rate in map(float, args.rates.split(",")):
            spec = TraceSpec(args.trace, args.num_requests, rate, cv, args.zipf, args.input_len, args.output_len, args.seed)
            rows.append({"rate": rate, "cv": cv} | {pol: run_policy(cfg, pol, spec, profile, profile_cost(profile))
                                                    for pol in policies})
    base = policies[0]
    print(f"{'cv':>4} {'rate':>6} " + " ".join(f"{pol + ' mean/p99 (' + base + '/x)':>34}" for pol in policies))
    for row in rows:
        cells = []
        for pol in policies:
            r, b = row[pol], row[base]
            cells.append(f"{r['jct_mean_s']:7.1f} /{r['jct_p99_s']:6.1f} s ({b['jct_mean_s'] / r['jct_mean_s']:4.2f}x/{b['jct_p99_s'] / r['jct_p99_s']:4.2f}x)")
        print(f"{row['cv']:>4g} {row['rate']:>6g} " + " ".join(f"{c:>34}" for c in cells))
    out.write_text(json.dumps({"args": vars(args), "profile": profile.to_dict(), "rows": rows}, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
