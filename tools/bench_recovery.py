#!/usr/bin/env python
"""Recovery benchmark: how long the server takes to serve again after a process is SIGKILLed.

Starts one server (embedded model, `spawn`), then for each round and each victim (a worker, the
broker) kills it while a request streams, and measures from the kill: the in-flight request's
error final, and the first request that succeeds again, sending one request every
`--probe-interval` seconds meanwhile (each must fail at once with `unavailable`, never hang).
The supervision target (issue 12): serving again within 30 s of a worker SIGKILL.

    python tools/bench_recovery.py --rounds 3 --out results/recovery.json

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from orca_mq.client import AsyncClient
from orca_mq.server.process import ServerHandle, free_port, spawn

VICTIMS = {"worker": "workers.main", "broker": "orca_mq.server.broker"}


async def _round(srv: ServerHandle, victim: str, probe_interval: float, timeout: float) -> dict[str, Any]:
    pid = srv.pid_of(VICTIMS[victim])
    async with AsyncClient(srv.address, ping_interval=0.5) as client:
        stream = client.stream(prompt="Once upon a time", max_tokens=1000, temperature=0.0, ignore_eos=True)
        await stream.__anext__()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        async for ev in stream:
            if ev.finished:
                break
        in_flight = {"final": ev.finish_reason, "code": ev.code, "after_s": time.monotonic() - killed}
    failures: list[float] = []
    while time.monotonic() - killed < timeout:
        async with AsyncClient(srv.address) as client:
            t0 = time.monotonic()
            out = await client.generate("Hello", max_tokens=2, temperature=0.0)
            if out.finish_reason == "length":
                return {"victim": victim, "in_flight": in_flight, "serving_again_s": time.monotonic() - killed,
                        "probes_failed": len(failures), "probe_error_s_max": max(failures, default=0.0)}
            failures.append(time.monotonic() - t0)
        await asyncio.sleep(probe_interval)
    return {"victim": victim, "in_flight": in_flight, "serving_again_s": None, "probes_failed": len(failures)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--victims", default="worker,broker")
    p.add_argument("--workers", type=int, default=1, help="engine.n_workers")
    p.add_argument("--probe-interval", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=180.0, help="give up on a round after this many seconds")
    p.add_argument("--out", type=Path, default=Path("results/recovery.json"))
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="orca_mq_recovery-"))
    sets = {"server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "server.http_address": "",
            "engine.n_workers": args.workers, "engine.threads_per_worker": max(1, 2 // args.workers),
            "log.dir": str(tmp / "logs"), "server.max_restarts": 2 * args.rounds * len(args.victims.split(","))}
    srv = spawn(sets, tmp / "launcher.stderr", ready_timeout=600)
    rounds = []
    try:
        for i in range(args.rounds):
            for victim in args.victims.split(","):
                rounds.append(asyncio.run(_round(srv, victim, args.probe_interval, args.timeout)) | {"round": i})
                print(json.dumps(rounds[-1]), flush=True)
    finally:
        srv.stop()
    summary = {}
    for victim in args.victims.split(","):
        times = [r["serving_again_s"] for r in rounds if r["victim"] == victim and r["serving_again_s"] is not None]
        summary[victim] = {"rounds": sum(r["victim"] == victim for r in rounds), "recovered": len(times),
                           "median_s": statistics.median(times) if times else None, "max_s": max(times, default=None),
                           "in_flight_error_s_max": max(r["in_flight"]["after_s"] for r in rounds if r["victim"] == victim),
                           "probe_error_s_max": max(r.get("probe_error_s_max", 0.0) for r in rounds if r["victim"] == victim)}
    print(f"\n{'victim':<8} {'rounds':>6} {'recovered':>9} {'median s':>9} {'max s':>7} {'in-flight err s':>15} {'probe err s':>11}")
    for victim, s in summary.items():
        print(f"{victim:<8} {s['rounds']:>6} {s['recovered']:>9} {s['median_s'] or float('nan'):>9.1f} "
              f"{s['max_s'] or float('nan'):>7.1f} {s['in_flight_error_s_max']:>15.2f} {s['probe_error_s_max']:>11.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "rounds": rounds}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
