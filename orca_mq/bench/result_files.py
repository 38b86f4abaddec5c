"""A benchmark result file, tools/bench.py's FILE.json: written here (strict JSON, atomic) and read
back as a `Run` by the figures and tables across runs (orca_mq/bench/sweep_plots.py, tools/plot.py).

    {"config": {...}, "summary": {...}, "requests": [...]}   (orca_mq/bench/metrics.py: the records)
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from orca_mq.server.process import ROOT


def jsonable(x: Any) -> Any:
    """Strict JSON: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def git_rev() -> str | None:
    """The checkout's short commit hash, recorded with a result (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_result(path: Path, config: dict, summary: dict, requests: list[dict]) -> None:
    """Strict JSON, config and summary indented, one request record per line; atomic (tmp + rename)."""
    def dump(x: Any, indent: int | None) -> str:
        return json.dumps(jsonable(x), indent=indent, allow_nan=False)

    body = (
        '{\n"config": ' + dump(config, 1) + ',\n"summary": ' + dump(summary, 1) + ',\n"requests": [\n'
        + ",\n".join(dump(r, None) for r in requests) + "\n]}\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(body)
    os.replace(tmp, path)


class Run:
    """One result file read back: its config (the settings a figure tells runs apart by) and summary."""

    def __init__(self, path: Path, data: dict[str, Any]):
        self.path = path
        self.config: dict[str, Any] = data["config"]
        self.summary: dict[str, Any] = data["summary"]
        self.rate = float(self.config.get("rate", "nan"))  # "inf" is stored as a string
        self.trace = str(self.config.get("trace"))

    def get(self, key: str) -> Any:
        v = self.config.get(key)
        if key in ("cv", "zipf") and self.trace != "fastserve":
            return None  # not a parameter of the orca trace
        return tuple(v) if isinstance(v, list) else v

    def m(self, key: str) -> float:
        v = self.summary.get(key)
        return float("nan") if v is None else float(v)


def load(paths: list[str]) -> list[Run]:
    """The result files with at least one successful request; the others are named on stderr and skipped."""
    runs = []
    for p in paths:
        path = Path(p)
        try:
            data = json.loads(path.read_text())
            run = Run(path, data)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"plot: skipping {path}: {e}", file=sys.stderr)
            continue
        if not run.summary.get("n_ok"):
            print(f"plot: skipping {path}: no successful request", file=sys.stderr)
            continue
        runs.append(run)
    return runs
