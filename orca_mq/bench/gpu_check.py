"""tools/gpu_check.py's run: every section in a process of its own under a time budget, inside one
deadline for the whole call; results streamed as JSON lines, then one table and one JSON file.

A section that fails, hangs or crashes (a CUDA error poisons a process's context) loses itself only:
its process is killed at its budget and the next one starts. The models build (CPU-bound) runs
beside the first sections, which need none.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from orca_mq.bench.gpu_carry import FOLDER, ROOT, ensure_packages
from orca_mq.bench.result_files import git_rev
from orca_mq.bench.shapes import ShapeRun


@dataclass(frozen=True)
class Section:
    name: str
    budget: float          # seconds on the GPU
    small_budget: float    # seconds with --small on a 2-core CPU
    needs_models: bool = True
    default: bool = True   # run without --sections (False: only when named)


# the run's order: cheap and model-free first (beside the models build), the headline figures before
# the re-confirmations, the costliest last; budgets sum past the deadline, which cuts whatever comes
# last. Issue 42's sections (memory, long contexts, FP8) run when named: `--sections
# decode,tune,splitkv,fp8,kvsize`, one call; so does issue 40's fused MoE kernel: `--sections moe`
SECTIONS = (Section("env", 15, 60, False), Section("refusal", 25, 60, False), Section("kernels", 40, 90, False),
            Section("decode", 70, 300, False, False), Section("tune", 120, 300, False, False),
            Section("moe", 60, 60, False, False),
            Section("exactness", 60, 120), Section("iteration", 80, 150), Section("offline", 50, 120),
            Section("served", 90, 240), Section("determinism", 45, 120), Section("fastserve", 45, 120),
            Section("splitkv", 40, 240, default=False), Section("fp8", 90, 240, default=False),
            Section("kvsize", 120, 180, default=False))
MODELS = Section("models", 75, 120, False)
# issue 42's published shapes, run by `--shape NAME` (one call per shape: orca_mq/bench/gpu_shapes.py)
SHAPE_SECTIONS = (Section("shape_iteration", 130, 240, False, False), Section("shape_burst", 300, 300, False, False))
SECTIONS += SHAPE_SECTIONS
DEADLINE_S, SMALL_DEADLINE_S = 345.0, 900.0   # the device call allows 6 minutes
TABLE_COLUMNS = ("section", "figure", "value", "target", "met")


class Report:
    """Result lines, in arrival order: echoed to stdout and appended to DIR/gpu_check.jsonl."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.jsonl: IO[str] = (out / "gpu_check.jsonl").open("w")

    def add(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, default=str)
        with self.lock:
            self.rows.append(row)
            self.jsonl.write(line + "\n")
            self.jsonl.flush()
            print(line, flush=True)

    def fail(self, section: str, figure: str, why: str) -> None:
        self.add({"section": section, "figure": figure, "shown": why[:160], "met": False, "error": why})


class Child:
    """One section's process: its JSON lines go to the report, anything else to WORK/NAME.log."""

    def __init__(self, section: Section, work: Path, small: bool, report: Report, shape: ShapeRun | None = None) -> None:
        self.section, self.report, self.t0 = section, report, time.monotonic()
        cmd = [sys.executable, "-u", "-m", "orca_mq.bench.gpu_sections", section.name, "--work", str(work)]
        cmd += shape.argv() if shape else []
        self.err = (work / f"{section.name}.err").open("w")
        self.proc = subprocess.Popen(cmd + ["--small"] * small, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     cwd=ROOT, env=child_env(), start_new_session=True)
        self.log = (work / f"{section.name}.log").open("w")
        self.emitted = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict) and row.get("section") == self.section.name:
                self.emitted = True
                self.report.add(row)
            else:
                self.log.write(line)

    def wait(self, timeout: float) -> None:
        """Until it exits or `timeout` passes (then its whole process group is killed); a failure with
        no row of its own becomes one."""
        name = self.section.name
        try:
            rc = self.proc.wait(max(timeout, 0.1))
        except subprocess.TimeoutExpired:   # SIGTERM first: the section kills the server it started
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            rc = None
        self.reader.join(5)
        self.err.close()
        self.log.close()
        took = time.monotonic() - self.t0
        if rc is None:
            self.report.fail(name, "timed out", f"killed after {took:.0f} s (budget {timeout:.0f} s left of the deadline)")
        elif rc != 0 and not any(r.get("section") == name and r.get("met") is False for r in self.report.rows):
            tail = (Path(self.err.name).read_text(errors="replace").strip().splitlines() or ["no stderr"])[-1]
            self.report.fail(name, f"exit {rc}", tail)
        self.report.add({"section": name, "detail": "section done", "s": round(took, 1), "exit": rc})


def child_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return os.environ | {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                         "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}


def run(out: Path, work: Path, names: list[str] | None, small: bool, deadline_s: float | None = None,
        shape: ShapeRun | None = None) -> int:
    t0 = time.monotonic()
    deadline = t0 + (deadline_s or (SMALL_DEADLINE_S if small else DEADLINE_S))
    work.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    chosen = [s for s in SECTIONS if (s.default if names is None else s.name in names)]
    report.add({"section": "setup", "detail": "start", "argv": sys.argv, "small": small, "sections": [s.name for s in chosen],
                "git": git_rev(), "deadline_s": round(deadline - t0), "shape": shape})
    try:
        report.add({"section": "setup", "detail": ensure_packages(FOLDER), "s": round(time.monotonic() - t0, 1)})
    except Exception as e:   # noqa: BLE001 - the sections then fail on their imports, each in its row
        report.fail("setup", "carried packages", f"{type(e).__name__}: {e}")
    models = Child(MODELS, work, small, report) if any(s.needs_models for s in chosen) else None
    for s in chosen:
        if s.needs_models and models is not None:
            models.wait(min(models.t0 + budget(MODELS, small), deadline) - time.monotonic())
            models = None
        left = deadline - time.monotonic()
        if left < 10:
            report.fail(s.name, "skipped", f"{left:.0f} s left of the {deadline - t0:.0f} s deadline")
            continue
        Child(s, work, small, report, shape).wait(min(budget(s, small), left))
    if models is not None:
        models.wait(deadline - time.monotonic())
    summary = {"elapsed_s": round(time.monotonic() - t0, 1), "rows": report.rows}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    _pack_logs(work, out / "gpu_check_logs.tgz")
    print(table(report.rows, f"gpu_check: {len(chosen)} sections in {summary['elapsed_s']:.0f} s "
                             f"({'--small, ' if small else ''}JSON: {out / 'gpu_check.json'})"))
    return 1 if any(r.get("met") is False and "error" in r for r in report.rows) else 0


def budget(s: Section, small: bool) -> float:
    return s.small_budget if small else s.budget


def table(rows: list[dict[str, Any]], title: str) -> str:
    cells = [TABLE_COLUMNS] + [(r["section"], r["figure"], _value(r), r.get("target") or "",
                                {True: "yes", False: "NO", None: "-"}[r.get("met")]) for r in rows if r.get("figure")]
    widths = [min(max(len(c[i]) for c in cells), cap) for i, cap in enumerate((11, 72, 56, 28, 3))]
    lines = [title] + [" | ".join(c[i][:w].ljust(w) for i, w in enumerate(widths)) for c in cells]
    lines.insert(2, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _value(r: dict[str, Any]) -> str:
    if r.get("shown"):
        return str(r["shown"])
    v = r.get("value")
    if isinstance(v, float):
        return f"{v:.3g} {r.get('unit', '')}".strip()
    return "" if v is None else f"{v} {r.get('unit', '')}".strip()


def _pack_logs(work: Path, dest: Path) -> None:
    """The sections' logs, bench outputs and the server's logs (small files only) in one archive."""
    with tarfile.open(dest, "w:gz") as tar:
        for f in sorted(work.rglob("*")):
            if f.is_file() and f.suffix in (".log", ".err", ".json", ".jsonl") and f.stat().st_size < 4 << 20 \
                    and "models" not in f.relative_to(work).parts and "model_src" not in f.relative_to(work).parts:
                tar.add(f, arcname=str(f.relative_to(work)))
