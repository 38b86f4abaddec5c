#!/usr/bin/env python
"""Reliability benchmark against a live server (tools/launch.py, embedded model, one worker):

1. fuzz: `--frames` undecodable client frames (orca_mq.bench.reliability.garbage_frames); every
   one must get an `error` reply with code `protocol`; the broker's RSS before and after;
2. oversize: three frames of max_frame_bytes + 16 MiB; the broker's RSS must not follow;
3. huge prompt: a short request's latency on the idle server, then sent 50 ms after another
   client's 20 MB prompt (refused by size) and after a ~150 kB one (tokenized, then refused);
4. overload: capacity + 50 requests at once: every `overloaded` reply within `--settle` seconds is
   counted (more than 50 would be over-refusal), and how fast they came;
5. soak: clients with aborts and garbage frames, plus clients that vanish mid-request: exactly
   one final per request, and every KV slot free at the end; then every request that ran to its
   length against the same prompt, temperature and seed alone on the idle server (reproducibility
   under load: `--set engine.deterministic=true` against the default);
6. HTTP fuzz (orca_mq.bench.http_fuzz): schemathesis from the server's own OpenAPI schema
   (`--http-schema-examples` positive and negative cases per operation) and `--http-bodies`
   hypothesis bodies: statuses, contract violations (a 5xx, a 4xx without OpenAI's error object),
   the HTTP process's RSS, and the server's health afterwards.

Prints a table and writes JSON (`--out`).

    python tools/bench_reliability.py --out results/reliability.json
    python tools/bench_reliability.py --soak-only --clients 8 --requests-per-client 150 --max-tokens 16 \
        --set engine.deterministic=true --out results/soak_deterministic.json
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from orca_mq.bench.bench_server import Server
from orca_mq.bench.http_fuzz import body_fuzz, schema_fuzz
from orca_mq.bench.reliability import SoakConfig, fuzz, garbage_frames, reproduce, soak
from orca_mq.client import AsyncClient
from orca_mq.config import load_config
from orca_mq.fair_share import FairShare
from orca_mq.protocol import encode
from orca_mq.protocol.client_msgs import Generate
from orca_mq.server.process import free_port


def _rss_mb(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def _latency(client: AsyncClient) -> float:
    t = time.perf_counter()
    out = await client.generate("The sky is", max_tokens=1, temperature=0.0)
    assert out.finish_reason == "length", out
    return time.perf_counter() - t


async def _huge_prompt(address: str) -> dict[str, Any]:
    """A short request from one client, alone and right after another client's huge prompt."""
    async with AsyncClient(address) as client, AsyncClient(address) as other:
        idle = statistics.median([await _latency(client) for _ in range(5)])
        out: dict[str, Any] = {"idle_ms": idle * 1e3}
        for name, prompt in (("20MB", "word " * (4 << 20)), ("150kB", "word " * 30_000)):
            t = time.perf_counter()
            big = asyncio.create_task(other.generate(prompt, max_tokens=1))
            await asyncio.sleep(0.05)  # the huge frame is on its way
            normal = await _latency(client)
            refused = await big
            out[f"{name}_refused_ms"] = (time.perf_counter() - t) * 1e3
            out[f"{name}_code"] = refused.code
            out[f"normal_during_{name}_ms"] = normal * 1e3
    return out


async def _overload(address: str, capacity: int, headroom: int, settle: float, extra: int = 50) -> dict[str, Any]:
    """capacity + extra requests at once, from one client: the extra ones and the `headroom` its fair share keeps
    for other clients (server.client_headroom) should get `overloaded` at once, and no other one. Every final
    within `settle` seconds is counted (served requests take far longer: they are left then)."""
    async with AsyncClient(address) as client:
        t = time.perf_counter()
        times: dict[asyncio.Task[Any], float] = {}

        def stamp(task: asyncio.Task[Any]) -> None:
            times[task] = time.perf_counter() - t

        tasks = [asyncio.create_task(client.generate("Count:", max_tokens=64, ignore_eos=True)) for _ in range(capacity + extra)]
        for task in tasks:
            task.add_done_callback(stamp)
        done, pending = await asyncio.wait(tasks, timeout=settle)
        codes = [task.result().code for task in done if not task.cancelled() and task.exception() is None]
        refused = sorted(times[task] for task in done if task.exception() is None and task.result().code == "overloaded")
        for task in pending:
            task.cancel()  # leaving a stream aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"sent": capacity + extra, "capacity": capacity, "expected_overloaded": extra + headroom, "overloaded": len(refused),
            "other_finals": len(codes) - len(refused), "still_running": len(pending), "settle_s": settle,
            "first_overloaded_ms": refused[0] * 1e3 if refused else None,
            "last_overloaded_ms": refused[-1] * 1e3 if refused else None}


async def _settled(address: str) -> dict[str, Any]:
    async with AsyncClient(address) as client:
        for _ in range(150):
            stats = await client.stats()
            if stats["scheduler"]["used_slots"] == 0 and stats["broker"]["tracked_requests"] == 0:
                break
            await asyncio.sleep(0.2)
    return {"used_slots": stats["scheduler"]["used_slots"], "tracked_requests": stats["broker"]["tracked_requests"],
            "active_requests": stats["frontend"]["active_requests"], "broker": stats["broker"]}


def _oversize(address: str, max_frame: int) -> None:
    import zmq

    ctx = zmq.Context()
    for i in range(3):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(encode(Generate(f"big{i}", prompt="x" * (max_frame + (16 << 20)))), copy=False, track=True).wait(120)
        sock.close()
    ctx.destroy(linger=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests-per-client", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=10.0, help="seconds the overload step counts finals for")
    ap.add_argument("--http-schema-examples", type=int, default=200, help="schemathesis cases per operation and mode")
    ap.add_argument("--http-bodies", type=int, default=5_000, help="hypothesis request bodies")
    ap.add_argument("--max-tokens", type=int, default=4, help="soak requests' max_tokens are drawn from 1..this")
    ap.add_argument("--soak-only", action="store_true", help="only the soak and its reproduction (steps 5)")
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value", help="server config")
    ap.add_argument("--out", default="results/reliability.json")
    args = ap.parse_args()
    cfg = load_config(None, args.set)
    capacity = cfg.server.max_waiting + cfg.scheduler.max_bs
    report: dict[str, Any] = {"args": vars(args)}
    http_port = free_port()
    with Server(1, 2, cfg.scheduler.max_bs, [f"server.http_address=127.0.0.1:{http_port}", *args.set]) as server:
        if not args.soak_only:
            _faults(server, report, args, capacity, FairShare.of(capacity, cfg.server.client_headroom).headroom,
                    cfg.server.max_frame_bytes)
        soak_cfg = SoakConfig(clients=args.clients, requests_per_client=args.requests_per_client, vanishing_clients=8,
                              max_tokens=args.max_tokens)
        res = asyncio.run(soak(server.address, soak_cfg, args.seed))
        report["soak"] = {**dataclasses.asdict(res), "config": dataclasses.asdict(soak_cfg)}
        report["soak"]["reproduced"] = asyncio.run(reproduce(server.address, report["soak"].pop("completed"), args.max_tokens))
        if not args.soak_only:
            report["http_fuzz"] = _http_fuzz(server, f"http://127.0.0.1:{http_port}", args)
        report["after"] = asyncio.run(_settled(server.address))
    _print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.out}")


def _faults(server: Any, report: dict[str, Any], args: argparse.Namespace, capacity: int, headroom: int,
            max_frame: int) -> None:
    """Steps 1-4: fuzz, oversize frames, huge prompts, overload."""
    broker = server.pid_of("orca_mq.server.broker")
    rng = random.Random(args.seed)
    rss0, t, totals = _rss_mb(broker), time.perf_counter(), {"frames": 0, "protocol": 0, "other": 0, "unanswered": 0}
    for start in range(0, args.frames, 10_000):
        res = asyncio.run(fuzz(server.address, garbage_frames(rng, min(10_000, args.frames - start))))
        totals["frames"] += res.frames
        totals["protocol"] += res.errors.get("protocol", 0)
        totals["other"] += res.other_replies + sum(n for c, n in res.errors.items() if c != "protocol")
        totals["unanswered"] += res.unanswered
    report["fuzz"] = {**totals, "frames_per_s": totals["frames"] / (time.perf_counter() - t),
                      "broker_rss_mb_before": rss0, "broker_rss_mb_after": _rss_mb(broker)}
    rss0 = _rss_mb(broker)
    _oversize(server.address, max_frame)
    time.sleep(1)
    report["oversize"] = {"frames": 3, "frame_mb": (max_frame + (16 << 20)) / 2**20,
                          "broker_rss_mb_before": rss0, "broker_rss_mb_after": _rss_mb(broker)}
    report["huge_prompt"] = asyncio.run(_huge_prompt(server.address))
    report["overload"] = asyncio.run(_overload(server.address, capacity, headroom, args.settle))
    asyncio.run(_settled(server.address))  # the overload step's aborted requests leave first


def _http_fuzz(server: Any, base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    http = server.pid_of("orca_mq.api.server")
    rss0, t = _rss_mb(http), time.perf_counter()
    schema = schema_fuzz(base_url, None, args.http_schema_examples, args.seed)
    bodies = body_fuzz(base_url, None, args.http_bodies, args.seed)
    import httpx

    return {"schema": schema.to_dict(), "bodies": bodies.to_dict(), "seconds": time.perf_counter() - t,
            "http_rss_mb_before": rss0, "http_rss_mb_after": _rss_mb(http),
            "health_after": httpx.get(f"{base_url}/health", timeout=30).json()["status"],
            "server_stderr_tracebacks": server.stderr().count("Traceback")}


def _print(r: dict[str, Any]) -> None:
    rows: list[tuple[str, str, str]] = []
    if "fuzz" in r:
        f, o, h, ov = r["fuzz"], r["oversize"], r["huge_prompt"], r["overload"]
        rows += [
            ("fuzz frames", f"{f['frames']}", f"protocol errors {f['protocol']}, other {f['other']}, unanswered {f['unanswered']}"),
            ("fuzz rate", f"{f['frames_per_s']:.0f}/s", f"broker RSS {f['broker_rss_mb_before']:.0f} -> {f['broker_rss_mb_after']:.0f} MB"),
            ("oversize", f"3 x {o['frame_mb']:.0f} MB", f"broker RSS {o['broker_rss_mb_before']:.0f} -> {o['broker_rss_mb_after']:.0f} MB"),
            ("idle latency", f"{h['idle_ms']:.0f} ms", "1-token request, median of 5"),
            ("20 MB prompt", f"{h['20MB_refused_ms']:.0f} ms", f"code {h['20MB_code']}; a normal request meanwhile {h['normal_during_20MB_ms']:.0f} ms"),
            ("150 kB prompt", f"{h['150kB_refused_ms']:.0f} ms", f"code {h['150kB_code']}; a normal request meanwhile {h['normal_during_150kB_ms']:.0f} ms"),
            ("overload", f"{ov['sent']} at once", f"{ov['overloaded']} overloaded (expected {ov['expected_overloaded']}), after "
                                                  f"{ov['first_overloaded_ms'] or 0:.0f}-{ov['last_overloaded_ms'] or 0:.0f} ms; "
                                                  f"{ov['other_finals']} other finals within {ov['settle_s']:g} s"),
        ]
    s, rep = r["soak"], r["soak"]["reproduced"]
    rows += [
        ("soak requests", f"{s['requests']}", f"missing finals {s['missing_finals']}, duplicates {s['duplicate_finals']}, {s['seconds']:.0f} s"),
        ("soak finals", "", ", ".join(f"{k} {v}" for k, v in sorted(s["finals"].items()))),
        ("soak faults", "", f"aborts {s['aborts_sent']}, garbage {s['garbage_sent']} (answered {s['garbage_answered']}), vanished requests {s['vanished_requests']}"),
        ("under load", f"{rep['mismatches']}/{rep['probes']}", f"requests whose tokens differ from the same one alone "
                                                               f"({rep['greedy_mismatches']}/{rep['greedy_probes']} greedy; {rep['runs_alone']} runs alone)"),
    ]
    if "http_fuzz" in r:
        hf = r["http_fuzz"]
        rows += [
            ("HTTP schema", f"{hf['schema']['requests']}", f"statuses {hf['schema']['statuses']}, violations {hf['schema']['violations']}"),
            ("HTTP bodies", f"{hf['bodies']['requests']}", f"statuses {hf['bodies']['statuses']}, violations {hf['bodies']['violations']}"),
            ("HTTP after", f"{hf['seconds']:.0f} s", f"health {hf['health_after']}, HTTP RSS {hf['http_rss_mb_before']:.0f} -> "
                                                      f"{hf['http_rss_mb_after']:.0f} MB, tracebacks on the terminal {hf['server_stderr_tracebacks']}"),
        ]
    a = r["after"]
    rows.append(("after", "", f"used KV slots {a['used_slots']}, broker tracked {a['tracked_requests']}, frontend active {a['active_requests']}"))
    for name, value, detail in rows:
        print(f"{name:<15} {value:>14}  {detail}")


if __name__ == "__main__":
    main()
