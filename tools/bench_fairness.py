#!/usr/bin/env python
"""What one request costs the others (issue 44): each attack, one request with its bounds at their
maxima (n = server.http_max_n, log probabilities up to server.http_max_logprobs, no max_tokens where
that is the attack), runs beside a bystander, another client sending small chat requests one after
another, and a /health poller. Measured: the bystander's latency p50/p99 idle and under the attack,
and /health's. Target: no attack raises the bystander's p99 above 2x its idle p99, nor /health's
p99 above 100 ms. A benign request of the same size (n = 16 short choices) is the control: what
sharing the batch costs on this engine, pathology aside. `queue_flood` is many requests (17 x 64
choices, one API key), reported beside; `many_messages` and `many_parts` four bodies at
server.http_max_body_bytes of small messages or of one message's text parts (validation costs a body's
elements). `one_request` is the host's floor: one ordinary request (one choice, generating to the context's end) keeps the engine busy, which is what any concurrent client does to
the bystander's iterations; each attack's p99 is also given against it. `long_prompt` is prompt_logprobs'
control: as long a prompt, ordinary, whose chunks of prefill (scheduler.max_num_batched_tokens an
iteration) cost the bystander's iterations what they cost. The server has two API keys, the attacker's and the
bystander's (each key one client for the fair shares). `--tiny` serves a random 2-layer Llama with
the embedded tokenizer: its layers cost little, so what is measured is what each request costs the
server's loops and queues, and the sampler's passes over the 49,152-token vocabulary for each of its
rows (on a CPU, twice the 2-layer forward when 16 choices sample under a mask; with the embedded
model the layers cost the bystander compute of their own). Beside each attack, what each server process
spent per worker iteration while it ran (CPU ms: the worker's two threads share the cores with the rest).
Prints a table and writes JSON (--out).

    python tools/bench_fairness.py --tiny --out results/fairness_tiny.json
    python tools/bench_fairness.py --out results/fairness.json
    python tools/bench_fairness.py --attacks pool_n16,closing_plan --window 30 --set engine.n_slots=16384
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from orca_mq.bench.bench_server import Server
from orca_mq.bench.steady import ROLES
from orca_mq.bench.timing import CpuTime, cpu_time
from orca_mq.client import Client
from orca_mq.config import load_config
from orca_mq.percentile import percentile
from orca_mq.server.process import free_port

ATTACKER, BYSTANDER = "attacker-key", "bystander-key"
SPACES_64 = 40686                # the embedded tokenizer's token of 64 spaces
CYRILLIC = "[\u0400-\u04ff]{900}"
CYRILLIC_SHORTEST = 1799          # its shortest output, in tokens (the frontend's search)
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What time is it?"}]


def attacks(max_n: int, max_choices: int, max_logprobs: int, max_len: int,
            max_body: int) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Each attack's requests: (path, body)."""
    per_choice = max_logprobs // (max_n * 21)          # positions one choice may carry at 20 alternatives
    tiny, part = {"role": "user", "content": "x"}, {"type": "text", "text": "x"}
    deep = "[" * 100_000 + "]" * 100_000
    chat = "/v1/chat/completions"
    return {
        "one_request": [(chat, {"messages": ASK, "max_tokens": max_len - 64, "ignore_eos": True})],
        "benign_n16": [(chat, {"messages": ASK, "n": max_n, "max_tokens": 64, "ignore_eos": True})],
        "pool_n16": [(chat, {"messages": ASK, "n": max_n})],
        "tool_whitespace": [(chat, {"messages": ASK, "tools": [TOOL], "n": max_n, "max_tokens": 400,
                                    "structured_outputs": {"regex": "<tool_call> +"}, "logit_bias": {str(SPACES_64): 100}})],
        "closing_plan": [(chat, {"messages": ASK, "n": max_n, "max_tokens": CYRILLIC_SHORTEST + 20,
                                 "structured_outputs": {"regex": CYRILLIC}})],
        # the control for prompt_logprobs: as long a prompt, ordinary (its own tokens: no prefix cached)
        "long_prompt": [("/v1/completions", {"prompt": [2000 + i for i in range(per_choice - 1)], "max_tokens": 1})],
        "prompt_logprobs": [("/v1/completions", {"prompt": [1000 + i for i in range(per_choice - 1)], "n": max_n,
                                                 "echo": True, "logprobs": 20, "max_tokens": 0})],
        "response_logprobs": [(chat, {"messages": ASK, "n": max_n, "logprobs": True, "top_logprobs": 20,
                                      "max_tokens": per_choice, "ignore_eos": True})],
        # a nucleus of most of the vocabulary: each choice's top-p over a nearly flat distribution at every step
        "nucleus": [(chat, {"messages": ASK, "n": max_n, "temperature": 2.0, "top_p": 0.99,
                            "max_tokens": max_len - 64, "ignore_eos": True})],
        # every logits processor at its bound on each choice: penalties over a growing history, 1,024 biases, min-p
        "processors": [(chat, {"messages": ASK, "n": max_n, "presence_penalty": 2.0, "frequency_penalty": 2.0,
                               "repetition_penalty": 100.0, "min_p": 0.5, "logit_bias": {str(t): 1.0 for t in range(1024)},
                               "max_tokens": max_len - 64, "ignore_eos": True})],
        "nested_args": [(chat, {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": deep}}]}], "tools": [TOOL]})],
        # bodies at the size bound of small elements (validation costs a body's elements): messages past the
        # bound on them (refused), and one message of text parts (accepted: one long prompt)
        "many_messages": [(chat, {"messages": [tiny] * _filling(tiny, max_body), "max_tokens": 1})] * 4,
        "many_parts": [(chat, {"messages": [{"role": "user", "content": [part] * _filling(part, max_body)}],
                               "max_tokens": 1})] * 4,
        "queue_flood": [("/v1/completions", {"prompt": ["Count:"] * max_choices, "max_tokens": 64, "ignore_eos": True})] * 17,
    }


def _filling(unit: dict[str, Any], max_body: int) -> int:
    """How many `unit`s, JSON-encoded as a list's elements, make a body at the size bound."""
    return (max_body - 100) // len(json.dumps(unit) + ", ")


def _attack(base: str, requests: list[tuple[str, dict[str, Any]]], conn: Any) -> None:
    """In its own process (its responses are big to read): imports done and connections open, it says
    so and waits for the word, then sends every request at once, each on its connection. On a host of
    two cores the client's own start (a Python process importing httpx: about a second of a core) would
    otherwise be counted as the attack's cost to the bystander."""
    import concurrent.futures

    clients = [httpx.Client(base_url=base, timeout=3600, headers={"authorization": f"Bearer {ATTACKER}"}) for _ in requests]
    for c in clients:
        c.get("/version")

    def one(i: int) -> tuple[int, float, int]:
        t = time.perf_counter()
        r = clients[i].post(requests[i][0], json={"model": None, **requests[i][1]})
        return r.status_code, time.perf_counter() - t, len(r.content)

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        conn.send("ready")
        conn.recv()
        conn.send(list(pool.map(one, range(len(requests)))))


async def _bystander(base: str, until: asyncio.Event, out: list[tuple[float, float]]) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=base, timeout=600, headers={"authorization": f"Bearer {BYSTANDER}"}) as http:
        while not until.is_set():
            t = time.perf_counter()
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            out.append((t, time.perf_counter() - t))


async def _poll(base: str, path: str, until: asyncio.Event, out: list[tuple[float, float]]) -> None:
    """`path` every 50 ms: /health (a stats round trip through every process once a second) and
    /version (the HTTP API's event loop alone)."""
    async with httpx.AsyncClient(base_url=base, timeout=600, headers={"authorization": f"Bearer {BYSTANDER}"}) as http:
        while not until.is_set():
            t = time.perf_counter()
            await http.get(path)
            out.append((t, time.perf_counter() - t))
            await asyncio.sleep(0.05)


async def measure(base: str, requests: list[tuple[str, dict[str, Any]]] | None, seconds: float,
                  least: float = 5.0) -> dict[str, Any]:
    """The bystander and /health for `seconds` (idle), or while the attack runs: the samples sent from
    the attack's first request to its last reply (at most `seconds`; at least `least`, so that an
    attack refused at once still has a bystander's worth of samples)."""
    until, lat, health, version = asyncio.Event(), [], [], []
    out: dict[str, Any] = {}
    proc = None
    if requests is not None:   # the attacker's process started and connected before anything is timed
        mine, theirs = multiprocessing.get_context("spawn").Pipe()
        proc = multiprocessing.get_context("spawn").Process(target=_attack, args=(base, requests, theirs), daemon=True)
        proc.start()
        while not mine.poll():
            if not proc.is_alive():
                raise RuntimeError(f"the attacker's process ended before it was ready (exit {proc.exitcode})")
            await asyncio.sleep(0.05)
        mine.recv()
    tasks = [asyncio.create_task(_bystander(base, until, lat)), asyncio.create_task(_poll(base, "/health", until, health)),
             asyncio.create_task(_poll(base, "/version", until, version))]
    t = time.perf_counter()
    if proc is None:
        await asyncio.sleep(seconds)
    else:
        mine.send("go")
        while proc.is_alive() and time.perf_counter() - t < seconds and not mine.poll():
            await asyncio.sleep(0.05)
        out["attack_s"] = time.perf_counter() - t
        await asyncio.sleep(max(0.0, least - out["attack_s"]))
        # off this loop: a wait here would stall the probes in flight, a cut attack's second counted as theirs
        if await asyncio.to_thread(mine.poll, 1):
            out["attack"] = [{"status": s, "seconds": round(d, 2), "bytes": b} for s, d, b in mine.recv()]
        else:
            out["attack"] = "cut at the window (the attacker left: its requests abort)"
        proc.terminate()
        await asyncio.to_thread(proc.join, 10)
    end = t + max(out.get("attack_s", seconds), least)
    until.set()
    await asyncio.gather(*tasks)
    window = [[d for at, d in xs if t <= at <= end] for xs in (lat, health, version)]
    return out | {"bystander_requests": len(window[0]), **_ms("bystander", window[0]), **_ms("health", window[1]),
                  **_ms("version", window[2])}


def _ms(name: str, xs: list[float]) -> dict[str, float]:
    return {f"{name}_p50_ms": (percentile(xs, 50) or 0.0) * 1e3, f"{name}_p99_ms": (percentile(xs, 99) or 0.0) * 1e3,
            f"{name}_max_ms": max(xs, default=0.0) * 1e3}


def usage(address: str, pids: dict[str, int]) -> tuple[int, dict[str, CpuTime]]:
    """The worker's iterations so far and each server process's CPU time."""
    with Client(address, api_key=BYSTANDER) as c:
        iterations = int(c.stats()["workers"][0]["iterations"])
    return iterations, {role: cpu_time(pid) for role, pid in pids.items()}


def settle(address: str, timeout: float = 300) -> None:
    """Until no request is active and no KV slot held (the last attack's aborts done)."""
    deadline = time.monotonic() + timeout
    with Client(address, api_key=BYSTANDER) as c:
        while (s := c.stats())["frontend"]["active_requests"] or s["scheduler"]["used_slots"] or s["broker"]["tracked_requests"]:
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not settle")
            time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attacks", default="", help="comma-separated names (default: all)")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds the bystander runs alone")
    ap.add_argument("--window", type=float, default=90.0, help="seconds an attack may run (then it is cut)")
    ap.add_argument("--tiny", action="store_true", help="a random 2-layer Llama, the embedded tokenizer (layers cheap, vocabulary not)")
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value", help="server config")
    ap.add_argument("--out", default="results/fairness.json")
    args = ap.parse_args()
    if args.tiny:
        from orca_mq.bench.random_models import random_llama
        args.set.append(f"model.path={random_llama(Path(tempfile.mkdtemp(prefix='fairness-')) / 'tiny', layers=2, max_positions=2048)}")
    cfg = load_config(overrides=args.set)
    max_len = min(cfg.model.max_model_len, 2048)
    plan = attacks(cfg.server.http_max_n, cfg.server.http_max_choices, cfg.server.http_max_logprobs, max_len,
                   cfg.server.http_max_body_bytes)
    names = [n for n in args.attacks.split(",") if n] or list(plan)
    port = free_port()
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg(), "python": platform.python_version()},
                              "config": args.set, "tiny": args.tiny, "window_s": args.window, "attacks": {}}
    with Server(1, 2, cfg.scheduler.max_bs, [f"server.http_address=127.0.0.1:{port}",
                                              f"server.api_key={ATTACKER},{BYSTANDER}", *args.set]) as server:
        base = f"http://127.0.0.1:{port}"
        asyncio.run(measure(base, None, 3.0))   # warm-up: the first requests load the template and the caches
        report["idle"] = idle = asyncio.run(measure(base, None, args.idle))
        pids = {role: server.pid_of(f"-m {module} ") for role, module in ROLES.items()}
        for name in names:
            settle(server.address)
            (it0, cpu0) = usage(server.address, pids)
            row = asyncio.run(measure(base, plan[name], args.window))
            (it1, cpu1) = usage(server.address, pids)
            # what each process spent per iteration while the bystander and the attack ran (the worker's two
            # threads share the host's cores with all of them)
            row["cpu_ms_per_iteration"] = {role: (cpu1[role] - cpu0[role]) * 1e3 / max(1, it1 - it0) for role in pids}
            row["bystander_p99_x_idle"] = row["bystander_p99_ms"] / idle["bystander_p99_ms"]
            row["met"] = row["bystander_p99_x_idle"] <= 2.0 and row["health_p99_ms"] <= 100.0
            report["attacks"][name] = row
            print(f"{name:18} bystander p50 {row['bystander_p50_ms']:7.0f} ms  p99 {row['bystander_p99_ms']:7.0f} ms "
                  f"({row['bystander_p99_x_idle']:4.1f}x idle)  /health p99 {row['health_p99_ms']:6.1f} max "
                  f"{row['health_max_ms']:6.1f} ms  /version max {row['version_max_ms']:6.1f} ms  "
                  f"{'met' if row['met'] else 'MISSED'}", flush=True)
            print(f"{'':18} CPU ms an iteration: " + ", ".join(f"{r} {v:.2f}" for r, v in row["cpu_ms_per_iteration"].items()),
                  flush=True)
    if (floor := report["attacks"].get("one_request")) is not None and floor["bystander_p99_ms"] > 0:
        for name, row in report["attacks"].items():
            row["bystander_p99_x_one_request"] = row["bystander_p99_ms"] / floor["bystander_p99_ms"]
        print("p99 against one ordinary request's: " + ", ".join(f"{n} {r['bystander_p99_x_one_request']:.1f}x"
                                                           for n, r in report["attacks"].items() if n != "one_request"))
    report["machine"]["load_avg_end"] = os.getloadavg()
    print(f"{'idle':18} bystander p50 {idle['bystander_p50_ms']:7.0f} ms  p99 {idle['bystander_p99_ms']:7.0f} ms  "
          f"/health p99 {idle['health_p99_ms']:6.1f} max {idle['health_max_ms']:6.1f} ms  /version max {idle['version_max_ms']:6.1f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
