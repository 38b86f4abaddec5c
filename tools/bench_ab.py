#!/usr/bin/env python3
"""A/B of two revisions of the engine: tools/bench_engine.py in a checkout of each, alternated round
by round (each round a fresh process per side), so that a shared machine's load swings hit both.

    python tools/bench_ab.py main HEAD --cases "decode b=1,decode b=32" --rounds 4 --out results/ab.json
    python tools/bench_ab.py HEAD~1 HEAD --set model.dtype=float32 --rounds 3 --out results/ab.json

Each revision is checked out (git worktree, detached) under --workdir; a side's median per case is
the median over rounds of each round's median iteration time. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from orca_mq.server.process import ROOT


def checkout(rev: str, workdir: Path) -> Path:
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True, check=True).stdout.strip()
    path = workdir / sha[:12]
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha], check=True,
                       capture_output=True)
    return path


def one_round(tree: Path, cases: str, repeat: int, sets: list[str], out: Path) -> dict[str, float]:
    cmd = [sys.executable, str(tree / "tools" / "bench_engine.py"), "--no-transformers", "--cases", cases,
           "--repeat", str(repeat), "--out", str(out), *(a for s in sets for a in ("--set", s))]
    subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True, text=True)
    return {r["case"]: r["ms"] for r in json.loads(out.read_text())["rows"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--cases", default="decode b=1,decode b=8,decode b=32,chunk: 256 of 512 @256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "orca_mq_ab"))
    ap.add_argument("--out", default="results/bench_ab.json")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    trees = {side: checkout(rev, workdir) for side, rev in (("a", args.a), ("b", args.b))}
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for side in ("ab" if r % 2 == 0 else "ba"):
            runs[side].append(one_round(trees[side], args.cases, args.repeat, args.set, workdir / f"{side}{r}.json"))
            print(f"round {r} {side}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in runs[side][-1].items()), flush=True)
    cases = list(runs["a"][0])
    med = {side: {c: statistics.median(run[c] for run in runs[side]) for c in cases} for side in runs}
    print(f"\n{'case':40} {args.a[:12]:>12} {args.b[:12]:>12} {'b / a':>7}")
    for c in cases:
        print(f"{c:40} {med['a'][c]:>12.1f} {med['b'][c]:>12.1f} {med['b'][c] / med['a'][c]:>7.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"a": args.a, "b": args.b, "sets": args.set, "runs": runs, "median_ms": med}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
