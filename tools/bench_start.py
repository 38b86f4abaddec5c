#!/usr/bin/env python3
"""A server's start: `orca-mq serve` to its ready line, then its first chat completion (the HTTP process
loads the tokenizer and chat template on it), its stop (SIGINT to the launcher's exit), and which of its processes map torch, for one or two revisions alternated round by round (each a git worktree, as tools/bench_ab.py makes them).

    python tools/bench_start.py --rounds 3 --out results/bench_start.json                 # this checkout
    python tools/bench_start.py --base c2dbde6 --model tiny --rounds 3 --out results/start_ab.json

--model: the embedded model (default), `tiny` (a 2-layer random Llama with the embedded tokenizer, what
the tests serve) or a path; --fresh: each start serves a copy of it in a new directory (as each test
module and each new download is served: nothing remembered by its path). Per process: whether it maps
torch and its CPU seconds to the ready line and the first chat. Prints a table (medians per side) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orca_mq.bench.timing import cpu_seconds  # noqa: E402
from orca_mq.server.process import READY_LINE, ROOT, free_port  # noqa: E402



def _s(seconds: object) -> str:
    """A round's figure, or '-' where it had none (not ready, the chat failed, the stop timed out)."""
    return "-" if seconds is None else f"{seconds:.2f}"


def start_once(tree: Path, model: str) -> dict[str, object]:
    http = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-u", "-m", "orca_mq.cli", "serve", "--set", f"server.frontend_address=tcp://127.0.0.1:{free_port()}",
            "--set", f"server.http_address={http}", "--set", "engine.n_slots=4096"]
    args += ["--set", f"model.path={model}"] if model else []
    t = time.monotonic()
    p = subprocess.Popen(args, cwd=tree, env=os.environ | {"PYTHONPATH": str(tree)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert p.stdout is not None
    ready = None
    for line in p.stdout:
        if line.startswith(READY_LINE):
            ready = time.monotonic() - t
            break
    chat = None
    if ready is not None:
        t = time.monotonic()
        r = httpx.post(f"http://{http}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        chat = time.monotonic() - t if r.status_code == 200 else None
    torch: dict[str, bool] = {}
    cpu: dict[str, float] = {}
    for pid in [str(p.pid), *subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            maps = Path(f"/proc/{pid}/maps").read_text()
            used = cpu_seconds(pid)
        except OSError:
            continue
        role = "launcher" if pid == str(p.pid) else next((c.rsplit(".", 1)[-1] for c in cmd if c.startswith(("orca_mq.", "workers."))), "?")
        role = {"main": "worker", "server": "http", "scheduler_process": "scheduler"}.get(role, role)
        torch[role], cpu[role] = "libtorch_cpu" in maps, used
    t = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)
    try:
        p.wait(60)
        stop: float | None = time.monotonic() - t
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stop = None
    return {"ready_s": ready, "first_chat_s": chat, "stop_s": stop, "torch": torch, "cpu_s": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="a revision to alternate with this checkout")
    ap.add_argument("--model", default="", help="'' (embedded), 'tiny' or a path")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fresh", action="store_true", help="each start serves a copy of the model in a new directory")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_start-"))
    model = a.model
    if model == "tiny":
        from orca_mq.bench.random_models import random_llama

        model = str(random_llama(work / "tiny", layers=2, max_positions=256, near_ties=False))
    if a.fresh and not Path(model).is_dir():
        ap.error("--fresh needs a model directory (tiny, or a path to one)")
    sides = {"this checkout": ROOT}
    if a.base:
        from tools.bench_ab import checkout

        sides = {a.base: checkout(a.base, work)} | sides
    runs: dict[str, list[dict[str, object]]] = {k: [] for k in sides}
    for r in range(a.rounds):
        for i, (name, tree) in enumerate(sides.items()):
            served = str(shutil.copytree(model, work / f"fresh-{r}-{i}")) if a.fresh else model
            runs[name].append(one := start_once(tree, served))
            print(f"round {r} {name}: ready {_s(one['ready_s'])} s, first chat {_s(one['first_chat_s'])} s, "
                  f"stop {_s(one['stop_s'])} s, torch in "
                  f"{', '.join(k for k, v in one['torch'].items() if v) or 'none'}", flush=True)   # type: ignore[union-attr]
        time.sleep(1)
    print("\n| side | median ready s | median first chat s | median stop s | ready, each round | processes that map torch | "
          "median CPU s, to ready and its first chat |\n|---|---:|---:|---:|---|---|---|")
    summary = {}
    for name, rs in runs.items():
        med = statistics.median(r["ready_s"] for r in rs if r["ready_s"] is not None)   # type: ignore[misc]
        chat = statistics.median(r["first_chat_s"] for r in rs if r["first_chat_s"] is not None)   # type: ignore[misc]
        stop = statistics.median(r["stop_s"] for r in rs if r["stop_s"] is not None)   # type: ignore[misc]
        with_torch = sorted({k for r in rs for k, v in r["torch"].items() if v})   # type: ignore[union-attr]
        roles = sorted({k for r in rs for k in r["cpu_s"]})   # type: ignore[union-attr]
        cpu = {k: statistics.median(r["cpu_s"][k] for r in rs if k in r["cpu_s"]) for k in roles}   # type: ignore[index,operator]
        summary[name] = {"median_ready_s": med, "median_first_chat_s": chat, "median_stop_s": stop, "torch": with_torch,
                         "median_cpu_s": cpu}
        each = ", ".join(f"{r['ready_s']:.1f}" for r in rs)
        shown = ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
        print(f"| {name} | {med:.2f} | {chat:.2f} | {stop:.2f} | {each} | {', '.join(with_torch)} | {shown} (all {sum(cpu.values()):.1f}) |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"model": a.model or "embedded", "summary": summary, "runs": runs}, indent=1))
    for tree in sides.values():   # the base's worktree and the tiny model: nothing left behind
        if tree != ROOT:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
