#!/usr/bin/env python3
"""The scheduling scorecard: every policy at every load, on an ORCA-shaped and a FastServe-shaped trace.

    python tools/scorecard.py --out results/scorecard.json [--rounds 2] [--loads 0.25,0.5,1,1.5]
        [--traces orca,fastserve] [--policies request,orca,fastserve,srpt] [--duration 60] [--set k=v ...]

One server per policy is started once (real processes, the ZeroMQ client) and kept for the whole run.
For each trace shape a burst of `--capacity-requests` requests on the orca server measures the
system's capacity: the requests per second it completes with every iteration full, from the burst's
own iterations (orca_mq/bench/scorecard.py: full_batch_capacity; the burst's completion rate is kept
too, as `burst_req_s`); each load is a fraction of it, with `load x capacity x --duration` requests
(within --min/--max-requests). Every round draws a new trace per (shape, load) and runs it on every
policy, the policies' order rotated each round; the request-level baseline runs the ORCA trace only
(the paper compares it there). `orca-again` in --policies runs a second orca server in each round:
its ratio to orca is the noise floor of every ratio; `fastserve-defer` (`-proactive`, `-reactive`) runs
fastserve with that `fastserve.kv_policy` on a server of its own. After each run the workers' record of
that run's iterations ([decodes, prompt tokens, compute ms]) is kept: each run reports its
iterations, decodes and compute per iteration, and the cost of one batch composition under
fastserve and under orca is compared at the end. `tools/simulate.py --scorecard FILE` replays the
same traces on the simulator.

Writes the runs, the medians (orca_mq/bench/scorecard.py), the targets of issue 21 judged from them,
and figures (FILE.<trace>.png: mean, p99 JCT, mean TTFT, median ITL against load; FILE.fig10.png:
median normalized latency against throughput on the ORCA trace, as ORCA's Fig. 10). `srpt` is an
oracle that knows output lengths; it is labelled as one everywhere.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from orca_mq.bench.metrics import summarize
from orca_mq.bench.replay import open_client, replay
from orca_mq.bench.scorecard import (CONTROL, METRICS, TRACES, aggregate, composition, full_batch_capacity,
                                     judge, mean_lengths, round_order, server_of, shape_cost_ratio, trace_spec)
from orca_mq.bench.trace import TraceSpec, load_corpus, make_trace, spec_dict
from orca_mq.config import load_config
from orca_mq.server.process import ServerHandle, free_port, spawn

LABEL = {"srpt": "srpt (oracle)", "request": "request-level", CONTROL: "orca again (A/A)"}   # else the label itself


def start(label: str, sets: list[str], logs: Path) -> ServerHandle:
    own = {"server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "server.http_address": "",
           "log.dir": str(logs / label), "log.level": "warning"}
    # --set for every server, then what the label is: its policy, a variant's settings
    return spawn(own | dict(s.split("=", 1) for s in sets) | server_of(label), logs / f"{label}.launch.log")


async def _settle(address: str, reset: bool, record: bool = False, timeout: float = 300.0) -> dict[str, Any]:
    """The server's stats once it is idle (no request active, no KV held)."""
    deadline = time.monotonic() + timeout
    async with open_client(address) as client:
        while True:
            stats = await client.stats()
            if stats["frontend"]["active_requests"] == 0 and not stats["scheduler"]["has_work"]:
                return await client.stats(record=record, reset=reset)
            if time.monotonic() > deadline:
                raise RuntimeError(f"server at {address} still busy after {timeout} s")
            await asyncio.sleep(0.2)


def run_trace(address: str, trace: list) -> tuple[dict[str, Any], list[list[float]], float]:
    """The run's summary with its iterations' composition, the workers' record of its iterations, and
    the median gap between two iterations of a worker (ms: scheduler turnaround and messaging)."""
    async def go() -> tuple[dict[str, Any], list[list[float]], float]:
        await _settle(address, reset=True)
        records, _ = await replay(address, trace, progress=False)
        stats = await _settle(address, reset=True, record=True)
        rows = [row for w in stats["workers"] if w for row in w.get("shapes", [])]
        gaps = [w["idle"]["median_ms"] for w in stats["workers"] if w and w["idle"]["median_ms"] is not None]
        return summarize(records) | composition(rows), rows, (statistics.median(gaps) if gaps else 0.0)

    return asyncio.run(go())


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    agg = result["aggregate"]
    for trace, loads in agg.items():
        fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
        for ax, (metric, title) in zip(axes, (("jct_mean_s", "mean JCT (s)"), ("jct_p99_s", "p99 JCT (s)"),
                                              ("ttft_mean_s", "mean TTFT (s)"), ("itl_p50_s", "median ITL (s)"))):
            for policy in (p for p in result["args"]["policies"] if p != CONTROL):
                pts = sorted((float(lo), p[policy][metric]) for lo, p in loads.items()
                             if policy in p and p[policy].get(metric) is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", ls="--" if policy == "srpt" else "-", label=LABEL.get(policy, policy))
            ax.set(xlabel="load (x capacity)", title=title)
        axes[0].legend()
        fig.suptitle(f"{trace} trace: medians of {result['args']['rounds']} interleaved rounds")
        fig.tight_layout()
        paths.append(out.with_suffix(f".{trace}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if "orca" in agg:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for policy in result["args"]["policies"]:
            pts = sorted((p[policy]["throughput_tok_s"], p[policy]["norm_latency_p50_s"] * 1000) for p in agg["orca"].values()
                         if policy in p and p[policy].get("norm_latency_p50_s"))
            if pts:
                ax.plot(*zip(*pts), marker="o", ls="--" if policy == "srpt" else "-", label=LABEL.get(policy, policy))
        ax.set(xlabel="throughput (tokens/s)", ylabel="median normalized latency (ms/token)", yscale="log",
               title="ORCA trace (ORCA Fig. 10)")
        ax.legend()
        fig.tight_layout()
        paths.append(out.with_suffix(".fig10.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def table(result: dict[str, Any]) -> str:
    lines = []
    for trace, loads in result["aggregate"].items():
        burst = result["burst_req_s"].get(trace)
        scale = "given" if burst is None else f"at full batch; the burst completed {burst:.2f} req/s"
        lines.append(f"\n{trace} trace (capacity {result['capacity'][trace]:.2f} req/s {scale}); medians, x = ratio to orca in the same round")
        lines.append(f"{'load':>5} {'policy':>16} {'mean JCT':>14} {'p99 JCT':>14} {'mean TTFT':>10} {'ITL p50':>14} {'tok/s':>7} "
                     f"{'its':>5} {'dec/it':>6} {'ms/it':>14}")
        for load, pol in sorted(loads.items(), key=lambda kv: float(kv[0])):
            for policy in result["args"]["policies"]:
                if (m := pol.get(policy)) is None:
                    continue
                def cell(k: str) -> str:
                    v, x = m.get(k), m.get(k + "/orca")
                    return "-" if v is None else f"{v:6.2f} ({x:4.2f}x)" if x is not None else f"{v:6.2f}"
                lines.append(f"{load:>5} {LABEL.get(policy, policy):>16} {cell('jct_mean_s'):>14} {cell('jct_p99_s'):>14} "
                             f"{m['ttft_mean_s'] or 0:10.2f} {cell('itl_p50_s'):>14} {m['throughput_tok_s'] or 0:7.1f} "
                             f"{m['iterations'] or 0:5.0f} {m['decodes_mean'] or 0:6.1f} {cell('compute_ms_mean'):>14}")
    lines.append("\ntargets (issue 21)")
    for row in result["targets"]:
        value = "n/a" if row["value"] is None else f"{row['value']:.3f}"
        verdict = {True: "met", False: "NOT met", None: "n/a"}[row["met"]]
        lines.append(f"  {verdict:>7}  {row['what']}: {value} (bound {row['bound']}) [{row['where']}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--loads", default="0.25,0.5,1,1.5")
    p.add_argument("--traces", default="orca,fastserve")
    p.add_argument("--policies", default="request,orca,fastserve,srpt")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals a run at load 1 spans")
    p.add_argument("--min-requests", type=int, default=40)
    p.add_argument("--max-requests", type=int, default=400)
    p.add_argument("--capacity-requests", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity", default="", metavar="TRACE=REQ_S,...",
                   help="use these capacities (e.g. a quiet run's) instead of the burst's: loads comparable across runs")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="section.key=value")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    policies, traces, loads = args.policies.split(","), args.traces.split(","), [float(x) for x in args.loads.split(",")]
    args.policies = policies
    logs = Path(tempfile.mkdtemp(prefix="orca_mq_scorecard-"))
    from orca_mq.tokenizer import load_tokenizer

    corpus = load_corpus(load_tokenizer("", "~/.cache/orca_mq"))
    servers = {pol: start(pol, args.sets, logs) for pol in policies}
    max_bs = load_config(None, args.sets).scheduler.max_bs
    given = {t: float(v) for t, v in (kv.split("=") for kv in args.capacity.split(",") if kv)}
    result: dict[str, Any] = {"args": vars(args), "logs": str(logs), "capacity": {}, "burst_req_s": {}, "runs": []}
    shapes: dict[str, dict[str, list[list[float]]]] = {t: {"orca": [], "fastserve": []} for t in traces}
    try:
        for trace in traces:
            if trace in given:   # no burst to run: the load scale is fixed
                result["capacity"][trace] = given[trace]
                print(f"{trace} trace: capacity {given[trace]:.2f} req/s (given)", file=sys.stderr)
                continue
            shape = TRACES[trace]
            burst = make_trace(TraceSpec(shape["kind"], args.capacity_requests, 0.0, shape["cv"], shape["zipf"],
                                         shape["input_len"], shape["output_len"], args.seed), corpus)
            summary, rows, gap_ms = run_trace(servers["orca"].address, burst)
            result["burst_req_s"][trace] = summary["throughput_req_s"]
            # never below what the burst itself completed (a fit of iterations slowed by other processes can be)
            result["capacity"][trace] = max(full_batch_capacity(rows, mean_lengths(trace), max_bs, gap_ms),
                                            summary["throughput_req_s"])
            print(f"{trace} trace: capacity {result['capacity'][trace]:.2f} req/s at full batch (the burst of {len(burst)} "
                  f"completed {summary['throughput_req_s']:.2f} req/s)", file=sys.stderr)
        for rnd in range(args.rounds):
            for trace in traces:
                for load in loads:
                    spec = trace_spec(trace, load, result["capacity"][trace], rnd, loads, args.duration,
                                      args.min_requests, args.max_requests, args.seed)
                    for policy in round_order(policies, trace, rnd):
                        summary, rows, _ = run_trace(servers[policy].address, make_trace(spec, corpus))
                        if policy in shapes[trace]:
                            shapes[trace][policy] += rows
                        result["runs"].append({"trace": trace, "load": load, "round": rnd, "policy": policy, "spec": spec_dict(spec),
                                               "summary": {k: summary.get(k) for k in (*METRICS, "n_ok", "n_errors")}})
                        print(f"round {rnd} {trace} load {load:g} {policy}: mean JCT {summary['jct_mean_s']:.2f} s, "
                              f"{summary['n_errors']} errors", file=sys.stderr)
                        out.write_text(json.dumps(result, indent=1, default=str))
    finally:
        for server in servers.values():
            server.stop()
    result["shape_cost"] = {t: shape_cost_ratio(s["fastserve"], s["orca"]) for t, s in shapes.items()}
    result["aggregate"] = aggregate(result["runs"])
    result["targets"] = judge(result["aggregate"], {t: c["ratio"] for t, c in result["shape_cost"].items()})
    out.write_text(json.dumps(result, indent=1, default=str))
    print(table(result))
    for path in plot(result, out):
        print(f"wrote {path}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
