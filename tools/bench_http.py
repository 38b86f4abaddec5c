#!/usr/bin/env python3
"""HTTP vs ZeroMQ on one orca-mq server, other orca-mq configurations (--variant), and (with --peer)
llama.cpp's server, on the same traces, runs interleaved round by round; prints medians over rounds
and ratios to the first contender, writes JSON and a plot.

    python tools/bench_http.py --rounds 3 [--peer /tmp/venv-peer/bin/python] --out results/http.json
    python tools/bench_http.py --rounds 2 --scenarios burst rate1 --backends http --peer /tmp/venv-peer/bin/python \
        --set scheduler.max_bs=32 --out results/peer.json          # issue 16's side-by-side
    python tools/bench_http.py --rounds 3 --scenarios chat --backends http --variant engine.prefix_caching=false \
        --peer /work/venv-llama/bin/python --out results/prefix_chat.json   # issue 22: caching on / off / llama.cpp

Scenarios: `c64` = 64 requests at t=0 (64 concurrent streams; throughput), `c1` = requests one
at a time, 2 s apart (the HTTP path's added latency per token, free of batching effects);
`burst` and `rate1` = issue 16's peer shape (64 requests, inputs 32-512, outputs 1-128 tokens),
all at t=0 or Poisson at 1 req/s; `chat` and `multiturn` = issue 22's chat-shaped traces (chat
messages, so /v1/chat/completions): 48 requests at t=0, each one of 4 system prompts of 448 tokens
(Zipf popularity, θ = 1) + a unique 24-96 token user turn, answers 16-64 tokens; and 8
conversations of 4 turns, started at t=0, each turn sent when the previous answer has come back,
with the conversation so far as its prompt (user turns 24-96, answers 16-64 tokens, no system
prompt of its own). Each --variant SET[,SET...] is one more orca-mq server (the --set config plus
those), measured with the same backends; the peer gets --peer-body merged into every request
(llama.cpp's `cache_prompt`). Every request is greedy with generation forced to max_tokens (ignore_eos). The machine is shared:
other work on it moves every number, which is why runs are interleaved and medians reported.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from orca_mq.bench.bench_server import on_sigterm
from orca_mq.bench.metrics import is_ok, summarize
from orca_mq.bench.openai_backend import OpenAIClient
from orca_mq.bench.plot_run import plot_cdfs
from orca_mq.bench.replay import open_client, replay
from orca_mq.bench.trace import (
    CHAT_KINDS, TraceSpec, load_corpus, make_chat_trace, make_trace, parse_range, spec_dict)
from orca_mq.server.process import ROOT, free_port, spawn

SCENARIOS = {  # name -> trace spec: all at once (c64) or deterministic 2 s gaps (c1); short, for a 2-core machine
    "c64": TraceSpec(kind="orca", num_requests=64, rate=0.0, input_len=(32, 128), output_len=(16, 32), seed=1),
    "c1": TraceSpec(kind="fastserve", num_requests=8, rate=0.5, cv=0.0, zipf=0.0, input_len=(32, 128),
                    output_len=(24, 32), seed=2),
    "burst": TraceSpec(kind="orca", num_requests=64, rate=0.0, input_len=(32, 512), output_len=(1, 128), seed=3),
    "rate1": TraceSpec(kind="orca", num_requests=64, rate=1.0, input_len=(32, 512), output_len=(1, 128), seed=4),
    "chat": TraceSpec(kind="chat", num_requests=48, rate=0.0, input_len=(24, 96), output_len=(16, 64), seed=5,
                      system_prompts=4, system_len=448),
    "multiturn": TraceSpec(kind="multiturn", num_requests=8, rate=0.0, input_len=(24, 96), output_len=(16, 64), seed=6,
                           system_prompts=0, turns=4),
}
SECONDS = ("makespan_s", "jct_mean_s")
KEYS = ("throughput_tok_s", "makespan_s", "jct_mean_s", "ttft_p50_s", "tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s")
CHAT_KEYS = ("makespan_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "jct_mean_s", "tpot_p50_s", "throughput_tok_s")
COUNTS = ("total_prompt_tokens", "total_cached_tokens")   # reported as they are (medians), no ratio


def start_peer(python: str, port: int, log: Path, slots: int, ctx: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([python, str(ROOT / "tools" / "peer_llamacpp.py"), "--port", str(port), "--n-parallel", str(slots),
                             "--ctx-per-slot", str(ctx), "--threads", "2"], stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"llama.cpp peer did not start; see {log}")
    return proc


def respec(spec: TraceSpec, changes: list[str]) -> TraceSpec:
    """The scenario's spec with FIELD=VALUE changes (each value read as the field's type), validated."""
    for change in changes:
        name, _, value = change.partition("=")
        if name not in TraceSpec.__dataclass_fields__ or name == "kind" or not value:
            raise ValueError(f"--spec {change!r}: expected FIELD=VALUE, FIELD a TraceSpec field other than kind")
        old = getattr(spec, name)
        spec = dataclasses.replace(spec, **{name: parse_range(value) if isinstance(old, tuple) else type(old)(value)})
    spec.validate()
    return spec


def ttft_by_turn(records: list[dict[str, Any]], turns: int) -> list[float]:
    """Mean TTFT of each turn's ok requests (NaN for a turn with none)."""
    ttfts: list[list[float]] = [[] for _ in range(turns)]
    for r in records:
        if is_ok(r) and r["first_token_s"] is not None:
            ttfts[r["turn"]].append(r["first_token_s"] - r["arrival_s"])
    return [statistics.fmean(x) if x else math.nan for x in ttfts]


def run(backend: str, target: str, trace: list, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    factory = open_client if backend == "zmq" else (lambda url: OpenAIClient(url, extra=extra))
    import uvloop

    records, _ = uvloop.run(replay(target, trace, progress=False, warmup=2, client_factory=factory))
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peer", default=None, metavar="PYTHON", help="a venv Python with xllamacpp: add llama.cpp's server")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--backends", nargs="+", default=["zmq", "http"], choices=["zmq", "http"], help="orca-mq's clients")
    p.add_argument("--peer-slots", type=int, default=16, help="llama.cpp server slots (continuous batching)")
    p.add_argument("--peer-ctx", type=int, default=1024, help="llama.cpp context per slot")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="orca-mq config (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="SET[,SET...]",
                   help="one more orca-mq server: the --set config plus these (repeatable)")
    p.add_argument("--peer-body", type=json.loads, default={"cache_prompt": True}, metavar="JSON",
                   help='fields added to every request to the peer (default {"cache_prompt": true})')
    p.add_argument("--spec", action="append", default=[], metavar="FIELD=VALUE",
                   help="change a TraceSpec field of every scenario run, e.g. system_prompts=4 (repeatable)")
    p.add_argument("--out", required=True, metavar="FILE.json")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)  # so `finally` stops the server and the peer
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    from orca_mq.tokenizer import load_tokenizer

    tok = load_tokenizer("", "~/.cache/orca_mq")
    corpus = load_corpus(tok)
    try:
        traces = {name: respec(spec, args.spec) for name, spec in SCENARIOS.items() if name in args.scenarios}
    except ValueError as e:
        p.error(str(e))
    base = {"scheduler.max_bs": 64, **dict(item.split("=", 1) for item in args.set)}
    servers = {"": base} | {v: base | dict(item.split("=", 1) for item in v.split(",")) for v in args.variant}
    launchers: list[Any] = []
    peer = None
    contenders: dict[str, tuple[str, str, dict[str, Any] | None]] = {}   # name -> (backend, address, extra body)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in traces}
    last: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in traces}   # the last round's records
    partial = out.with_suffix(".partial.json")
    try:
        for i, (variant, sets) in enumerate(servers.items()):
            zmq_addr, http = f"tcp://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            tag = f".{i}" if i else ""
            launchers.append(spawn(sets | {"server.frontend_address": zmq_addr, "server.http_address": http,
                                           "log.dir": out.resolve().with_suffix(f"{tag}.logs")},
                                   out.with_suffix(f"{tag}.launch.log"), ready_timeout=600.0))
            for b in args.backends:
                label = " ".join([b] + [f"{k.split('.')[-1]}={v}" for k, v in
                                         (item.split("=", 1) for item in variant.split(",") if item)])
                contenders[label] = (b, {"zmq": zmq_addr, "http": f"http://{http}"}[b], None)
        if args.peer:
            port = free_port()
            peer = start_peer(args.peer, port, out.with_suffix(".peer.log"), args.peer_slots, args.peer_ctx)
            contenders["llama.cpp"] = ("http", f"http://127.0.0.1:{port}", args.peer_body)
        for scen in results:
            results[scen] = {name: [] for name in contenders}
        for r in range(args.rounds):
            for scen, spec in traces.items():
                # fresh prompts every round: llama.cpp's server reuses a cached prompt prefix, and a
                # repeated trace would hand its later rounds their prefills for free
                spec = dataclasses.replace(spec, seed=spec.seed + 1000 * r)
                trace = make_chat_trace(spec, corpus, tok.decode) if spec.kind in CHAT_KINDS else make_trace(spec, corpus)
                for name in (list(contenders) if r % 2 == 0 else list(contenders)[::-1]):
                    t = time.perf_counter()
                    last[scen][name] = records = run(*contenders[name][:2], trace, contenders[name][2])
                    summary = summarize(records)
                    if spec.kind == "multiturn":
                        summary["ttft_mean_by_turn_s"] = ttft_by_turn(records, spec.turns)
                    results[scen][name].append(summary)
                    partial.write_text(json.dumps(results, default=str))   # what is done so far, if the run is cut short
                    print(f"round {r} {scen} {name}: {summary['n_ok']}/{summary['n_requests']} ok, "
                          f"{summary['throughput_tok_s']:.1f} tok/s, makespan {summary['makespan_s']:.1f} s, "
                          f"TTFT mean {summary['ttft_mean_s'] * 1e3:.0f} ms, cached {summary['total_cached_tokens']} "
                          f"of {summary['total_prompt_tokens']} prompt tokens ({time.perf_counter() - t:.0f} s)",
                          file=sys.stderr, flush=True)
    finally:
        if peer is not None:
            peer.terminate()
            peer.wait(30)
        for launcher in launchers:
            launcher.stop(60.0)
    table = report(results)
    print(table)
    for scen, runs in last.items():
        plot_cdfs(runs, out.with_name(f"{out.stem}.{scen}.png"), f"{scen}: last round")
    out.write_text(json.dumps({"scenarios": {k: spec_dict(v) for k, v in traces.items()}, "rounds": args.rounds,
                               "summaries": results, "table": table, "last_round_records": last}, default=str))
    print(f"wrote {out} and {out.stem}.<scenario>.png")
    return 0


def report(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = []
    for scen, by_name in results.items():
        chat = SCENARIOS[scen].kind in CHAT_KINDS
        keys = CHAT_KEYS if chat else KEYS
        first = next(iter(by_name))
        lines.append(f"\n{scen}: median over rounds (ratio to {first})")
        lines.append(f"{'contender':<24}" + "".join(f"{k:>22}" for k in keys + (COUNTS if chat else ())))
        med = {name: {k: statistics.median(s[k] for s in runs) for k in keys} for name, runs in by_name.items()}
        for name, runs in by_name.items():
            cells = []
            for k in keys:
                scale = 1.0 if k.startswith("throughput") or k in SECONDS else 1000.0
                cells.append(f"{med[name][k] * scale:>14.1f} ({med[name][k] / med[first][k]:.2f}x)")
            if chat:
                cells += [f"{statistics.median(s[k] or 0 for s in runs):>22.0f}" for k in COUNTS]
            lines.append(f"{name:<24}" + "".join(cells))
        for k in ("makespan_s", "ttft_mean_s") if chat else ():
            lines.append(f"{k} per round, ratio to {first}: " + "; ".join(
                f"{name} " + " ".join(f"{a[k] / b[k]:.2f}" for a, b in zip(runs, by_name[first]))
                for name, runs in by_name.items() if name != first))
        if SCENARIOS[scen].kind == "multiturn":
            lines.append("mean TTFT (ms) of turn 0, 1, ... (median over rounds): " + "; ".join(
                f"{name} " + " ".join(f"{statistics.median(s['ttft_mean_by_turn_s'][t] for s in runs) * 1e3:.0f}"
                                      for t in range(len(runs[0]["ttft_mean_by_turn_s"])))
                for name, runs in by_name.items()))
    lines.append("\nthroughput in tok/s, makespan and mean JCT in s, other latencies in ms; prompt and cached tokens "
                 "as the servers report them")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
