#!/usr/bin/env python3
"""Replay a benchmark trace through the real schedulers on a virtual clock: what each policy, and a
clairvoyant bound, could do for JCT on this engine.

    python tools/simulate.py --trace fastserve --rate 2 --cv 4 --zipf 1.5 --output-len 1:512 --max-bs 4 \\
        [--policies orca,fastserve,srpt] [--set section.key=value ...] [--profile FILE.json] --out FILE.json

The schedulers are the serving system's own classes (orca_mq/sched/), fed the
same trace as tools/bench.py (same spec and seed -> same lengths and arrivals). Only the engine is
replaced: an iteration takes the time the FastServe start-up profile predicts (initiation time of
each prompt plus one increment iteration at the batch's decode size), measured on this machine
by running the real engine's probes (`--profile` reuses a saved one; without it the profile is
measured and saved next to --out). One pipeline stage, no swap or messaging cost.

`srpt` is not a policy of the system: it knows every request's output length (which no server
does) and always runs the requests with the least remaining work, shortest-remaining-processing-
time first, the classic optimum for mean JCT. Its ratio to `orca` bounds what any
non-clairvoyant policy (FastServe's MLFQ included) can gain on the trace.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from orca_mq.bench.trace import DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN, TraceSpec, make_trace, parse_range  # noqa: E402
from orca_mq.config import Config, load_config  # noqa: E402
from orca_mq.protocol.iteration import IterationPlan, IterationResult  # noqa: E402
from orca_mq.sched.profiler import IterationProfile, profile_engine, profile_max_len  # noqa: E402
from orca_mq.sampling_params import SamplingParams  # noqa: E402
from orca_mq.sched import Scheduler, make_scheduler  # noqa: E402
from orca_mq.sched.orca import OrcaScheduler  # noqa: E402
from orca_mq.sched.request import Request  # noqa: E402
from orca_mq.engine.model_info import ModelInfo, read_model_info  # noqa: E402

DUMMY_CORPUS = list(range(100, 5000))   # ids do not matter here, only lengths (the trace draws the same numbers)


class SrptOracle(OrcaScheduler):
    """Clairvoyant bound: least remaining predicted work first (its prefill, if not done, plus one
    increment per remaining token), up to max_bs. KV is never short here (the pool is sized for all)."""

    def __init__(self, cfg: Config, info: ModelInfo, profile: IterationProfile) -> None:
        super().__init__(cfg, info)
        self.profile = profile

    def remaining(self, req: Request) -> float:
        prefill = self.profile.initiation_time(len(req.prompt_token_ids)) if req.n_iterations == 0 else 0.0
        return prefill + (req.params.max_tokens - len(req.output_token_ids)) * self.profile.increment_time(self.max_bs)

    def select(self, now: float) -> list[Request]:
        return sorted((r for r in self.pool.values() if not r.running), key=self.remaining)[: self.max_bs]


def iteration_time(plan: IterationPlan, profile: IterationProfile) -> float:
    """Prefills cost their initiation time beyond a batch-1 increment; the decodes one increment."""
    base = profile.increment_time(1)
    prefills = [len(s.token_ids) for s in plan.seqs if len(s.token_ids) > 1]
    decodes = len(plan.seqs) - len(prefills)
    return sum(profile.initiation_time(n) - base for n in prefills) + profile.increment_time(max(decodes, 1))


def simulate(sched: Scheduler, requests: list[Request], profile: IterationProfile) -> dict[str, float]:
    now, i, finish = 0.0, 0, {}
    while i < len(requests) or sched.has_work():
        while i < len(requests) and requests[i].arrival <= now:
            sched.add(requests[i])
            i += 1
        plan = sched.schedule(now)
        if plan is None:
            if i == len(requests):
                raise RuntimeError("the scheduler holds requests but schedules none (KV pool too small?)")
            now = requests[i].arrival
            continue
        now += iteration_time(plan, profile)
        result = IterationResult(plan.iteration, [s.request_id for s in plan.seqs], [0] * len(plan.seqs))
        for event in sched.process_result(result, now):
            if event.finish_reason:
                finish[event.request_id] = now
    jct = sorted(finish[r.request_id] - r.arrival for r in requests)
    return {"jct_mean_s": statistics.mean(jct), "jct_p50_s": statistics.median(jct),
            "jct_p99_s": jct[min(len(jct) - 1, int(0.99 * len(jct)))], "makespan_s": now}


def measured_profile(cfg: Config, info: ModelInfo) -> IterationProfile:
    from orca_mq.engine.model_runner import ModelRunner

    runner = ModelRunner(cfg, info=info)
    return profile_engine(runner.execute, runner.block_size, runner.kv.num_blocks, profile_max_len(cfg, info),
                          cfg.scheduler.max_bs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", choices=("orca", "fastserve"), required=True)
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
    p.add_argument("--profile", default=None, help="IterationProfile JSON (default: measure it now and save it)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sets = [*args.sets] + ([f"scheduler.max_bs={args.max_bs}"] if args.max_bs else [])
    cfg = load_config(None, sets)
    info = read_model_info(cfg.model.path, cfg.model.cache_dir)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.profile:
        profile = IterationProfile.load(args.profile)
    else:
        profile = measured_profile(cfg, info)
        profile.save(out.with_suffix(".profile.json"))
    rows = []
    for cv in map(float, args.cvs.split(",")):
        for rate in map(float, args.rates.split(",")):
            spec = TraceSpec(args.trace, args.num_requests, rate, cv, args.zipf, args.input_len, args.output_len, args.seed)
            row = {"rate": rate, "cv": cv}
            for policy in args.policies.split(","):
                pcfg = load_config(None, [*sets, f"scheduler.policy={'orca' if policy == 'srpt' else policy}",
                                          "engine.n_slots=1048576"])  # KV never binds: scheduling alone is compared
                sched = SrptOracle(pcfg, info, profile) if policy == "srpt" else make_scheduler(pcfg, info)
                sched.use_profile(profile)
                reqs = [Request(f"r{t.index}", t.prompt_token_ids, SamplingParams(max_tokens=t.max_tokens, ignore_eos=True),
                                t.arrival_s) for t in make_trace(spec, DUMMY_CORPUS)]
                row[policy] = simulate(sched, reqs, profile)
            rows.append(row)
    base = args.policies.split(",")[0]
    print(f"{'cv':>4} {'rate':>6} " + " ".join(f"{pol + ' mean/p99 (x ' + base + ')':>34}" for pol in args.policies.split(",")))
    for row in rows:
        cells = []
        for pol in args.policies.split(","):
            r, b = row[pol], row[base]
            cells.append(f"{r['jct_mean_s']:7.1f} /{r['jct_p99_s']:6.1f} s ({b['jct_mean_s'] / r['jct_mean_s']:4.2f}x/{b['jct_p99_s'] / r['jct_p99_s']:4.2f}x)")
        print(f"{row['cv']:>4g} {row['rate']:>6g} " + " ".join(f"{c:>34}" for c in cells))
    out.write_text(json.dumps({"args": vars(args), "profile": profile.to_dict(), "rows": rows}, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
