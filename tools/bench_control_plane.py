#!/usr/bin/env python
"""The control plane's price per generated token on the CPU (issue 32, item 4): a narrow Llama (30
layers of hidden 64, compute negligible) serves a burst from several client processes; prints served
vs offline generated tokens/s on the same burst and KV room, and the CPU microseconds the broker,
frontend, scheduler (and worker, clients) spend per generated token; writes JSON (--out).
Library: orca_mq/bench/control_plane.py.

    python tools/bench_control_plane.py [--requests 256] [--input-len 32:512] [--output-len 128:128]
        [--max-bs 128] [--budget 2048] [--threads 1] [--layers 30] [--client-procs 4] [--rounds 3] --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from orca_mq.bench.control_plane import Setup, run, table
from orca_mq.bench.trace import parse_range


def main(argv: list[str] | None = None) -> int:
    d = Setup()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=d.requests, help="requests in the burst, all sent at once")
    p.add_argument("--input-len", type=parse_range, default=d.input_len, metavar="MIN:MAX", help="prompt tokens, uniform")
    p.add_argument("--output-len", type=parse_range, default=d.output_len, metavar="MIN:MAX",
                   help="generated tokens, uniform, forced (ignore_eos)")
    p.add_argument("--max-bs", type=int, default=d.max_bs)
    p.add_argument("--budget", type=int, default=d.budget, help="scheduler.max_num_batched_tokens")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads of the engine (offline) and the worker")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--client-procs", type=int, default=d.client_procs, help="client processes sharing the burst")
    p.add_argument("--rounds", type=int, default=3, help="offline/served pairs, interleaved; the table adds medians")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", required=True, metavar="FILE.json")
    args = p.parse_args(argv)
    setup = Setup(args.requests, args.input_len, args.output_len, args.max_bs, args.budget, args.threads, args.layers,
                  args.client_procs, args.seed)
    with tempfile.TemporaryDirectory(prefix="orca_mq_control_plane-") as work:
        result = run(setup, args.rounds, Path(work))
    print(table(result))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
