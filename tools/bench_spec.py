#!/usr/bin/env python
"""Speculative decoding (n-gram prompt lookup, issue 35) served: two servers, speculation off and on,
take the same greedy chat requests, interleaved round by round: copy-heavy requests (correct, rewrite
or extract a misspelt paragraph) one at a time and as a burst, and open-ended ones as a burst. Prints
makespans, their ratio on/off (median over rounds), tokens per decode step, the acceptance counters and
how many greedy outputs changed; writes JSON (--out). Library: orca_mq/bench/spec_bench.py.

    python tools/bench_spec.py [--requests 16] [--rounds 3] [--dtype auto|float32] [--model PATH]
        [--set section.key=value ...] --out FILE.json
    python tools/bench_spec.py --small --out FILE.json        # 3 short requests, 1 round: a smoke run
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

from orca_mq.bench.bench_server import on_sigterm
from orca_mq.bench.spec_bench import Setup, run, table

SMALL = {"requests": 3, "rounds": 1, "words": 24, "max_tokens_cap": 24}


def main(argv: list[str] | None = None) -> int:
    d = Setup()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=d.requests, help="requests per workload (paragraphs cycle past 16)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="off/on pairs per scenario, interleaved")
    p.add_argument("--model", default=d.model, help="model.path; '' = the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default=d.dtype, help="model.dtype: auto (what users get) or float32 (exact)")
    p.add_argument("--seed", type=int, default=d.seed, help="the misspellings' seed")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="section.key=value",
                   help="for both servers (speculative.method is the bench's: off, then ngram)")
    p.add_argument("--small", action="store_true", help=f"a smoke run: {SMALL}")
    p.add_argument("--out", required=True, metavar="FILE.json")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)   # a terminate still stops both servers
    setup = Setup(a.requests, a.rounds, a.model, a.dtype, a.seed, sets=tuple(a.sets))
    if a.small:
        setup = replace(setup, **SMALL)
    result = run(setup).to_dict()
    print(table(result["summary"]))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
