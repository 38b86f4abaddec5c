"""The served scheduling code on a virtual clock: a benchmark trace replayed through the real
policies' `Scheduler.step()` (the same as the offline `LLM` and the scheduler process), the engine
replaced by a cost model; one pipeline stage, no swap or messaging cost. tools/simulate.py is its
command line.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orca_mq import SamplingParams
from orca_mq.percentile import percentile
from orca_mq.bench.scorecard import CONTROL, trace_spec
from orca_mq.bench.trace import TraceSpec, make_trace
from orca_mq.config import Config
from orca_mq.models.registry import read_model_info
from orca_mq.protocol.iteration import IterationPlan, IterationResult
from orca_mq.sched import Scheduler, make_scheduler
from orca_mq.sched.profiler import IterationProfile
from orca_mq.sched.request import Request

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


def _pct(values: list[float], p: float) -> float:
    """The served statistic (metrics.percentile: a simulated p99 is a served p99), NaN over nothing."""
    value = percentile(values, p)
    return float("nan") if value is None else value


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
            results = [IterationResult(plan.iteration, [0] * len(plan.seqs))]
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
    return {"jct_mean_s": statistics.mean(jct), "jct_p50_s": _pct(jct, 50), "jct_p99_s": _pct(jct, 99),
            "ttft_mean_s": statistics.mean(ttft) if ttft else float("nan"), "itl_p50_s": _pct(itl, 50),
            "norm_latency_p50_s": _pct(norm, 50), "makespan_s": now - start, "throughput_req_s": len(finish) / max(now - start, 1e-9)}


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
