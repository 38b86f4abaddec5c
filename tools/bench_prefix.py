#!/usr/bin/env python3
"""Time to first token of a prompt whose long prefix is in the prefix cache against one of the same
length whose tokens are all new, on one running server (interleaved pairs, so both see the same load).

    python tools/bench_prefix.py [--prefix-len 448] [--suffix-len 48] [--pairs 8] [--set k=v ...] --out FILE.json

Each pair sends, one request at a time (max_tokens=1): a prompt = the shared prefix + a new suffix
(its prefix cached by a warm-up request), then a prompt of random tokens of the same length. Prints
median TTFTs and their ratio; writes every sample to FILE.json.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from orca_mq.client import Client
from orca_mq.server.process import free_port, spawn

VOCAB = (1000, 40000)   # ordinary tokens of the embedded model's vocabulary


def ttft(client: Client, tokens: list[int]) -> float:
    t0 = time.perf_counter()
    for _ in client.stream(prompt_token_ids=tokens, max_tokens=1, temperature=0.0, ignore_eos=True):
        return time.perf_counter() - t0
    raise RuntimeError("no token")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix-len", type=int, default=448)
    p.add_argument("--suffix-len", type=int, default=48)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="section.key=value")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rnd = random.Random(a.seed)
    draw = lambda n: [rnd.randrange(*VOCAB) for _ in range(n)]  # noqa: E731
    prefix = draw(a.prefix_len)
    sets = {"server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "server.http_address": "",
            **dict(s.split("=", 1) for s in a.sets)}
    with tempfile.TemporaryDirectory() as tmp:
        srv = spawn({**sets, "log.dir": f"{tmp}/logs"}, Path(tmp) / "launcher.stderr")
        try:
            with Client(srv.address) as client:
                ttft(client, prefix + draw(a.suffix_len))      # warm-up: computes (and caches) the prefix
                cached, fresh = [], []
                for _ in range(a.pairs):
                    cached.append(ttft(client, prefix + draw(a.suffix_len)))
                    fresh.append(ttft(client, draw(a.prefix_len + a.suffix_len)))
                stats = client.stats()["scheduler"]
        finally:
            srv.stop()
    med_c, med_f = statistics.median(cached), statistics.median(fresh)
    print(f"{'prompt':<22}{'median TTFT (ms)':>18}")
    print(f"{'prefix cached':<22}{med_c * 1e3:>18.1f}")
    print(f"{'all new tokens':<22}{med_f * 1e3:>18.1f}")
    print(f"ratio cached/new: {med_c / med_f:.2f}  (prefix_cache_hits {stats.get('prefix_cache_hits')} tokens)")
    Path(a.out).write_text(json.dumps({"args": vars(a), "cached_s": cached, "fresh_s": fresh,
                                       "median_ratio": med_c / med_f, "scheduler": stats}, indent=1))


if __name__ == "__main__":
    main()
