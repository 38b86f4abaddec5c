#!/usr/bin/env python
"""A chat turn behind a long prompt: its time to first token and its latency, with chunked prefill.

A server on the embedded model (HTTP API, one worker of two threads); each trial sends one prompt of
--prompt-len token ids (its own ids each trial: no prefix cached, max_tokens 1) and, --delays seconds
after it, short streamed chat requests (4 tokens, greedy) from the same client. What it shows: whether a
short prompt is fed while the long one's chunks are (scheduler.max_num_batched_tokens an iteration),
and how long an iteration with a chunk in it takes on this host. Prints a table and writes JSON.

    python tools/bench_behind_prompt.py --out results/behind_prompt.json
    python tools/bench_behind_prompt.py --set scheduler.max_num_batched_tokens=64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import httpx

from orca_mq.bench.bench_server import Server
from orca_mq.percentile import percentile
from orca_mq.server.process import free_port

ASK = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


async def _short(http: httpx.AsyncClient, start: float, delay: float) -> tuple[float, float]:
    """A streamed chat turn sent `delay` s after `start`: (time to first token, latency), seconds."""
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    sent, first = time.perf_counter(), None
    async with http.stream("POST", "/v1/chat/completions", json={"model": None, **ASK, "stream": True}) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - sent
    return first or float("nan"), time.perf_counter() - sent


async def trials(base: str, prompt_len: int, delays: list[float], n: int) -> list[dict[str, Any]]:
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await http.post("/v1/chat/completions", json={"model": None, **ASK})   # warm: the chat template, the first graphs
        for trial in range(n):
            ids = [3000 + (trial * prompt_len + i) % 40000 for i in range(prompt_len)]
            start = time.perf_counter()

            async def long() -> float:
                await http.post("/v1/completions", json={"model": None, "prompt": ids, "max_tokens": 1})
                return time.perf_counter() - start

            took, *shorts = await asyncio.gather(long(), *(_short(http, start, d) for d in delays))
            out.append({"long_s": took, "short": [{"delay_s": d, "ttft_s": f, "latency_s": e} for d, (f, e) in zip(delays, shorts)]})
            print(f"trial {trial}: long prompt {took:.2f} s; " + "; ".join(
                f"short at {d:.1f} s: first token {f:.2f} s, last {e:.2f} s" for d, (f, e) in zip(delays, shorts)), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=779, help="the long prompt's tokens (779: bench_fairness's long_prompt)")
    ap.add_argument("--delays", default="0.3,0.8", help="seconds after the long prompt each short request is sent")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value", help="server config")
    ap.add_argument("--out", default="results/behind_prompt.json")
    args = ap.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    port = free_port()
    with Server(1, 2, 32, [f"server.http_address=127.0.0.1:{port}", *args.set]):
        rows = asyncio.run(trials(f"http://127.0.0.1:{port}", args.prompt_len, delays, args.trials))
    print(f"{'short sent at':>14} {'first token p50':>16} {'max':>8} {'last token p50':>15} {'max':>8}")
    for i, d in enumerate(delays):
        ttft = [r["short"][i]["ttft_s"] for r in rows]
        lat = [r["short"][i]["latency_s"] for r in rows]
        print(f"{d:>12.1f} s {percentile(ttft, 50):>14.2f} s {max(ttft):>6.2f} s {percentile(lat, 50):>13.2f} s {max(lat):>6.2f} s")
    print(f"long prompt: p50 {percentile([r['long_s'] for r in rows], 50):.2f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                                          "config": args.set, "prompt_len": args.prompt_len, "trials": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
