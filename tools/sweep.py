#!/usr/bin/env python3
"""Run a grid of benchmarks unattended, one tools/bench.py run per point, then plot.

    python tools/sweep.py --trace orca --policies orca,request --rates 0.5,1,2,4 --max-bs 4,16 \\
        --num-requests 200 --outdir results/orca [--set section.key=value ...]
    python tools/sweep.py --trace fastserve --policies fastserve,orca --rates 1,2 --cvs 1,4 --zipfs 0.9,1.5 \\
        --outdir results/fastserve

Every point writes DIR/<name>.json, named from the point:
    <trace>_<policy>_bs<B>_rate<R>[_cv<CV>_zipf<THETA>]_n<N>_seed<S>.json   (cv/zipf for the fastserve trace)
with its bench output in DIR/<name>.log and the launcher's in DIR/<name>.launch.log. A point whose
file exists with at least one successful request is skipped, so an interrupted sweep resumes where it
stopped. The file name does not encode --set, --input-len or --output-len: use one DIR per setting.
At the end tools/plot.py makes the figures in DIR/plots.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from orca_mq.server.process import ROOT


def floats(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        v = float(part)
        if math.isnan(v) or v < 0:
            raise argparse.ArgumentTypeError(f"expected numbers >= 0, got {part!r}")
        out.append(v)
    return out


def ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",")]


def words(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def num(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:g}"


def point_name(trace: str, policy: str, bs: int, rate: float, cv: float, zipf: float, n: int, seed: int) -> str:
    shape = f"_cv{num(cv)}_zipf{num(zipf)}" if trace == "fastserve" else ""
    return f"{trace}_{policy}_bs{bs}_rate{num(rate)}{shape}_n{n}_seed{seed}"


def done(path: Path) -> bool:
    try:
        return bool(json.loads(path.read_text())["summary"].get("n_ok"))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--trace", required=True, choices=("orca", "fastserve"))
    p.add_argument("--policies", type=words, default=None,
                   help="comma list (default orca,request for the orca trace, fastserve,orca for the fastserve trace)")
    p.add_argument("--rates", type=floats, required=True, help="comma list of req/s (inf = all at once)")
    p.add_argument("--max-bs", type=ints, default=[16], help="comma list (default 16)")
    p.add_argument("--cvs", type=floats, default=[1.0], help="comma list, fastserve trace (default 1)")
    p.add_argument("--zipfs", type=floats, default=[1.0], help="comma list, fastserve trace (default 1)")
    p.add_argument("--seeds", type=ints, default=[0], help="comma list (default 0)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--input-len", default=None, metavar="MIN:MAX")
    p.add_argument("--output-len", default=None, metavar="MIN:MAX")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="section.key=value")
    p.add_argument("--address", default=None, help="use a running system (its policy/max_bs must match the points)")
    p.add_argument("--outdir", required=True)
    p.add_argument("--bench-args", default="", help="extra tools/bench.py arguments, one shell-quoted string")
    p.add_argument("--bench", default=str(ROOT / "tools" / "bench.py"), help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)

    if args.policies is None:
        args.policies = ["orca", "request"] if args.trace == "orca" else ["fastserve", "orca"]
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    cvs = args.cvs if args.trace == "fastserve" else [1.0]
    zipfs = args.zipfs if args.trace == "fastserve" else [1.0]
    # The policies of one point run back to back, alternating which goes first, so that a shared
    # host's drift in speed (it lasts minutes) hits the runs compared with each other alike.
    points = [(policy, *point) for j, point in enumerate(itertools.product(args.max_bs, cvs, zipfs, args.rates, args.seeds))
              for policy in (args.policies if j % 2 == 0 else args.policies[::-1])]

    def stop_child(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_child)
    failed: list[str] = []
    t_sweep = time.monotonic()
    for i, (policy, bs, cv, zipf, rate, seed) in enumerate(points, 1):
        name = point_name(args.trace, policy, bs, rate, cv, zipf, args.num_requests, seed)
        out = outdir / f"{name}.json"
        tag = f"[{i}/{len(points)}] {name}"
        if done(out):
            print(f"{tag}: exists, skipped", flush=True)
            continue
        cmd = [sys.executable, args.bench, "--policy", policy, "--trace", args.trace, "--num-requests",
               str(args.num_requests), "--rate", num(rate), "--max-bs", str(bs), "--seed", str(seed),
               "--out", str(out), "--no-progress"]
        if args.trace == "fastserve":
            cmd += ["--cv", num(cv), "--zipf", num(zipf)]
        if args.input_len:
            cmd += ["--input-len", args.input_len]
        if args.output_len:
            cmd += ["--output-len", args.output_len]
        for s in args.sets:
            cmd += ["--set", s]
        if args.address:
            cmd += ["--address", args.address]
        cmd += shlex.split(args.bench_args)
        if args.dry_run:
            print(shlex.join(cmd))
            continue
        print(f"{tag}: running", flush=True)
        t = time.monotonic()
        with open(outdir / f"{name}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
            try:
                rc = proc.wait()
            except KeyboardInterrupt:
                proc.send_signal(signal.SIGTERM)  # bench stops its launcher on SIGTERM
                proc.wait()
                print(f"{tag}: interrupted; rerun the same command to resume", file=sys.stderr)
                return 130
        if rc == 0 and done(out):
            s = json.loads(out.read_text())["summary"]
            nl = s.get("norm_latency_p50_s")
            print(f"{tag}: ok in {time.monotonic() - t:.0f} s: {s['throughput_tok_s']:.1f} tok/s, "
                  f"JCT mean {s['jct_mean_s']:.2f} s, p99 {s['jct_p99_s']:.2f} s, "
                  f"norm p50 {nl * 1000 if nl is not None else float('nan'):.1f} ms/tok, errors {s['n_errors']}",
                  flush=True)
        else:
            failed.append(name)
            print(f"{tag}: FAILED (exit {rc}); see {outdir / (name + '.log')}", flush=True)

    if args.dry_run:
        return 0
    print(f"sweep: {len(points) - len(failed)}/{len(points)} points done in {time.monotonic() - t_sweep:.0f} s", flush=True)
    if not args.no_plot:
        files = sorted(str(f) for f in outdir.glob("*.json"))
        if files:
            subprocess.run([sys.executable, str(ROOT / "tools" / "plot.py"), *files, "--out", str(outdir / "plots")])
    if failed:
        print("sweep: failed points: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
