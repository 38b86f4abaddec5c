#!/usr/bin/env python3
"""HTTP vs ZeroMQ on one orca-mq server, and (with --peer) llama.cpp's server, on the same traces,
runs interleaved round by round; prints medians over rounds and ratios, writes JSON and a plot.

    python tools/bench_http.py --rounds 3 [--peer /work/venv-peer/bin/python] --out results/http.json

Scenarios: `c64` = 64 requests at t=0 (64 concurrent streams; throughput), `c1` = requests one
at a time, 2 s apart (the HTTP path's added latency per token, free of batching effects).
Every request is greedy with generation forced to max_tokens (ignore_eos). The machine is shared:
other work on it moves every number, which is why runs are interleaved and medians reported.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from bench import Launcher, _on_sigterm, free_tcp_port  # noqa: E402  (tools/bench.py)
from orca_mq.bench.metrics import summarize  # noqa: E402
from orca_mq.bench.openai_backend import OpenAIClient  # noqa: E402
from orca_mq.bench.plot_run import plot_cdfs  # noqa: E402
from orca_mq.bench.replay import open_client, replay  # noqa: E402
from orca_mq.bench.trace import TraceSpec, load_corpus, make_trace, spec_dict  # noqa: E402

SCENARIOS = {  # name -> trace spec: all at once (c64) or deterministic 2 s gaps (c1); short, for a 2-core machine
    "c64": TraceSpec(kind="orca", num_requests=64, rate=0.0, input_len=(32, 128), output_len=(16, 32), seed=1),
    "c1": TraceSpec(kind="fastserve", num_requests=8, rate=0.5, cv=0.0, zipf=0.0, input_len=(32, 128),
                    output_len=(24, 32), seed=2),
}
KEYS = ("throughput_tok_s", "ttft_p50_s", "tpot_p50_s", "itl_p50_s", "itl_p99_s", "jct_p50_s")


def start_peer(python: str, port: int, log: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([python, str(ROOT / "tools" / "peer_llamacpp.py"), "--port", str(port), "--n-parallel", "64",
                             "--ctx-per-slot", "512", "--threads", "2"], stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"llama.cpp peer did not start; see {log}")
    return proc


def run(backend: str, target: str, trace: list) -> list[dict[str, Any]]:
    factory = open_client if backend == "zmq" else (lambda url: OpenAIClient(url))
    import uvloop

    records, _ = uvloop.run(replay(target, trace, progress=False, warmup=2, client_factory=factory))
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peer", default=None, metavar="PYTHON", help="a venv Python with xllamacpp: add llama.cpp's server")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--out", required=True, metavar="FILE.json")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)  # so `finally` stops the server and the peer
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    from orca_mq.tokenizer import load_tokenizer

    corpus = load_corpus(load_tokenizer(""))
    traces = {name: make_trace(spec, corpus) for name, spec in SCENARIOS.items() if name in args.scenarios}
    zmq_addr, http = f"tcp://127.0.0.1:{free_tcp_port()}", f"127.0.0.1:{free_tcp_port()}"
    sets = ["scheduler.max_bs=64", f"server.frontend_address={zmq_addr}", f"server.http_address={http}",
            f"server.backend_address=ipc:///tmp/orca_mq_bench_http_{os.getpid()}", f"server.worker_base_port={free_tcp_port()}",
            f"log.dir={out.with_suffix('.logs')}"]
    launcher = Launcher(sets, out.with_suffix(".launch.log"), 600.0, 60.0)
    targets = {"zmq": zmq_addr, "http": f"http://{http}"}
    peer = None
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s: {b: [] for b in targets} for s in traces}
    last: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in traces}   # the last round's records
    partial = out.with_suffix(".partial.json")
    try:
        launcher.start()
        if args.peer:
            port = free_tcp_port()
            peer = start_peer(args.peer, port, out.with_suffix(".peer.log"))
            targets["llama.cpp"] = f"http://127.0.0.1:{port}"
            for s in results.values():
                s["llama.cpp"] = []
        for r in range(args.rounds):
            for scen, trace in traces.items():
                for backend, target in (list(targets.items()) if r % 2 == 0 else list(targets.items())[::-1]):
                    t = time.perf_counter()
                    last[scen][backend] = records = run(backend, target, trace)
                    summary = summarize(records)
                    results[scen][backend].append(summary)
                    partial.write_text(json.dumps(results, default=str))   # what is done so far, if the run is cut short
                    print(f"round {r} {scen} {backend}: {summary['n_ok']}/{summary['n_requests']} ok, "
                          f"{summary['throughput_tok_s']:.1f} tok/s, ITL p50 {summary['itl_p50_s'] * 1e3:.1f} ms "
                          f"({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    finally:
        if peer is not None:
            peer.terminate()
            peer.wait(30)
        launcher.stop()
    table = report(results)
    print(table)
    for scen, runs in last.items():
        plot_cdfs(runs, out.with_name(f"{out.stem}.{scen}.png"), f"{scen}: last round")
    out.write_text(json.dumps({"scenarios": {k: spec_dict(SCENARIOS[k]) for k in traces}, "rounds": args.rounds,
                               "summaries": results, "table": table, "last_round_records": last}, default=str))
    print(f"wrote {out} and {out.stem}.<scenario>.png")
    return 0


def report(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = []
    for scen, by_backend in results.items():
        lines.append(f"\n{scen}: median over rounds (ratio to zmq)")
        lines.append(f"{'backend':<11}" + "".join(f"{k:>22}" for k in KEYS))
        base = {k: statistics.median(s[k] for s in by_backend["zmq"]) for k in KEYS}
        for backend, runs in by_backend.items():
            cells = []
            for k in KEYS:
                v = statistics.median(s[k] for s in runs)
                scale = 1.0 if k.startswith("throughput") else 1000.0
                cells.append(f"{v * scale:>14.1f} ({v / base[k]:.2f}x)")
            lines.append(f"{backend:<11}" + "".join(cells))
    lines.append("\nthroughput in tok/s, latencies in ms")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
