#!/usr/bin/env python3
"""Replay a benchmark trace through the served scheduling code on a virtual clock: what each policy,
and the SRPT oracle, could do for JCT on this engine.

    python tools/simulate.py --trace fastserve --rates 2 --cvs 4 --zipf 1.5 --output-len 1:512 \\
        [--policies orca,fastserve,srpt] [--set section.key=value ...] [--profile FILE.json] --out FILE.json
    python tools/simulate.py --scorecard results/scorecard.json [--profile FILE.json] --out FILE.json

The schedulers are the serving system's own policies, driven through the same `Scheduler.step()`
as the offline `LLM` and the scheduler process, fed the same trace as tools/bench.py (same spec and
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
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from orca_mq.bench.cost_model import gpt3_175b_profile  # noqa: E402
from orca_mq.bench.scorecard import CONTROL, trace_spec  # noqa: E402
from orca_mq.bench.trace import DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN, TraceSpec, make_trace, parse_range  # noqa: E402
from orca_mq.config import Config, load_config  # noqa: E402
from orca_mq.protocol.iteration import IterationPlan, IterationResult  # noqa: E402
from orca_mq.sampling_params import SamplingParams  # noqa: E402
from orca_mq.sched import Scheduler, make_scheduler  # noqa: E402
from orca_mq.sched.profiler import IterationProfile  # noqa: E402
from orca_mq.sched.request import Request  # noqa: E402
from orca_mq.engine.model_info import read_model_info  # noqa: E402

DUMMY_CORPUS = list(range(100, 5000))   # ids do not matter here, only lengths (the trace draws the same numbers)
Cost = Callable[[IterationPlan], float]


def profile_cost(profile: IterationProfile) -> Cost:
    """Prefill chunks cost their initiation time beyond a batch-1 increment; the decodes one increment."""
    base = profile.increment_time(1)

    def cost(plan: IterationPlan) -> float:
        prefills = [len(s.token_ids) for s in plan.seqs if len(s.token_ids) > 1 or s.start_pos == 0]
        decodes = len(plan.seqs) - len(prefills)
        return sum(profile.initiation_time(n) - base for n in prefills) + profile.increment_time(max(decodes, 1))

    return cost


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def simulate(sched: Scheduler, requests: list[Request], cost: Cost) -> dict[str, float]:
    """Drive `sched.step()` on a virtual clock: arrivals at their times, one stage, each plan taking
    `cost(plan)` seconds. Returns the serving metrics tools/bench.py reports."""
    if sched.n_workers != 1:
        raise ValueError("the simulator models one pipeline stage (engine.n_workers = 1)")
    now, i, results = 0.0, 0, []
    arrival = {r.request_id: r.arrival for r in requests}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    finish: dict[str, float] = {}
    itl: list[float] = []
    while True:
        while i < len(requests) and requests[i].arrival <= now:
            sched.add(requests[i])
            i += 1
        out = sched.step(now, results)
        for ev in out.events:
            if ev.token_id is not None:
                if ev.request_id in last:
                    itl.append(now - last[ev.request_id])
                first.setdefault(ev.request_id, now)
                last[ev.request_id] = now
            if ev.finish_reason:
                finish[ev.request_id] = now
        results = []
        if out.plans:
            plan = out.plans[0]
            now += cost(plan)
            results = [IterationResult(plan.iteration, [s.request_id for s in plan.seqs], [0] * len(plan.seqs))]
        elif i < len(requests):
            now = requests[i].arrival
        elif sched.has_work():
            raise RuntimeError("the scheduler holds requests but schedules none (KV pool too small?)")
        else:
            break
    jct = [finish[r] - arrival[r] for r in finish]
    tokens = {r.request_id: r.params.max_tokens for r in requests}
    norm = [(finish[r] - arrival[r]) / tokens[r] for r in finish]   # ORCA's Fig. 10 latency: per generated token
    ttft = [first[r] - arrival[r] for r in first]
    start = min(arrival.values(), default=0.0)
    return {"jct_mean_s": statistics.mean(jct), "jct_p50_s": _pct(jct, 0.5), "jct_p99_s": _pct(jct, 0.99),
            "ttft_mean_s": statistics.mean(ttft) if ttft else float("nan"), "itl_p50_s": _pct(itl, 0.5),
            "norm_latency_p50_s": _pct(norm, 0.5), "makespan_s": now - start, "throughput_req_s": len(finish) / max(now - start, 1e-9)}


def trace_requests(spec: TraceSpec) -> list[Request]:
    return [Request(f"r{t.index}", t.prompt_token_ids, SamplingParams(max_tokens=t.max_tokens, ignore_eos=True), t.arrival_s)
            for t in make_trace(spec, DUMMY_CORPUS)]


def run_policy(cfg: Config, policy: str, spec: TraceSpec, profile: IterationProfile, cost: Cost) -> dict[str, float]:
    pcfg = Config.from_dict(cfg.to_dict())
    pcfg.set("scheduler.policy", policy)
    sched = make_scheduler(pcfg, read_model_info(pcfg.model.path, pcfg.model.cache_dir))
    sched.use_profile(profile)
    return simulate(sched, trace_requests(spec), cost)


def replay_scorecard(path: str, cfg: Config, profile: IterationProfile) -> list[dict[str, Any]]:
    """Each (trace, load, round) a scorecard served, simulated for its policies: per point, the served
    and the simulated mean JCT ratios to orca (medians over rounds), the simulated means."""
    card = json.loads(Path(path).read_text())
    a = card["args"]
    runs: dict[tuple[str, float, int], dict[str, float]] = defaultdict(dict)
    specs: dict[tuple[str, float, int], TraceSpec] = {}
    for r in card["runs"]:
        key = (r["trace"], float(r["load"]), int(r["round"]))
        runs[key][r["policy"]] = r["summary"]["jct_mean_s"]
        if "spec" in r:   # a scorecard from before the per-load draws has none: one draw per round, as below
            d = r["spec"]
            specs[key] = TraceSpec(**{**d, "input_len": tuple(d["input_len"]), "output_len": tuple(d["output_len"])})
    rows: dict[tuple[str, float], dict[str, Any]] = {}
    for (trace, load, rnd), pols in sorted(runs.items()):
        spec = specs.get((trace, load, rnd)) or trace_spec(trace, load, card["capacity"][trace], rnd, [load], a["duration"],
                                                           a["min_requests"], a["max_requests"], a["seed"])
        sim = {pol: run_policy(cfg, pol, spec, profile, profile_cost(profile))["jct_mean_s"] for pol in pols if pol != CONTROL}
        row = rows.setdefault((trace, load), {"trace": trace, "load": load, "n": spec.num_requests, "sim": {}, "served": {}})
        for pol in pols:
            row["served"].setdefault(pol, []).append(pols[pol] / pols["orca"])
            if pol in sim:
                row["sim"].setdefault(pol, []).append(sim[pol] / sim["orca"])
                row.setdefault("sim_jct_mean_s", {}).setdefault(pol, []).append(sim[pol])
    for row in rows.values():
        for key in ("sim", "served", "sim_jct_mean_s"):
            row[key] = {pol: statistics.median(v) for pol, v in row[key].items()}
    return list(rows.values())


def measured_profile(sets: list[str]) -> IterationProfile:
    """This machine's profile, measured as a FastServe server measures it at start-up (offline: one stage)."""
    from orca_mq import LLM

    llm = LLM(**{k.replace(".", "__"): v for k, v in (s.split("=", 1) for s in sets)}, scheduler__policy="fastserve")
    assert llm.scheduler.profile is not None
    return llm.scheduler.profile


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
