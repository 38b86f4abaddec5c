"""Structured JSON-lines logs: one file per process under `log.dir` (stderr too with `log.stderr`).

Every line carries `role` and `pid`; callers bind `request_id` / `iteration` where they have one
(`log.bind(request_id=...)`). `tools/launch.py logs` merges the files by timestamp.
The standard library's logging (uvicorn, transformers, torch) and Python warnings go to the same
JSON lines, so nothing reaches a terminal as a bare traceback.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

# structlog's dev module imports rich where it is installed (0.2 s of each process's start) for a console
# renderer these JSON logs never use: hidden from that import (a process that has rich keeps it)
_NO_RICH = "rich" not in sys.modules
if _NO_RICH:
    sys.modules["rich"] = None  # type: ignore[assignment]
try:
    import structlog
finally:
    if _NO_RICH:
        del sys.modules["rich"]

from orca_mq.config import LogConfig
from orca_mq.percentile import percentile


def tell(t0: float, text: str) -> None:
    """A line for people on stderr (start-up progress, a failure): `orca-mq [  12.3s] text`, seconds since t0."""
    print(f"orca-mq [{time.monotonic() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)


class _TeeLogger:
    """structlog's final logger: writes each rendered line to every stream."""

    def __init__(self, streams: list[TextIO]) -> None:
        self._streams = streams

    def msg(self, line: str) -> None:
        for s in self._streams:
            try:
                s.write(line + "\n")
                s.flush()
            except (OSError, ValueError):
                pass  # a closed stderr at shutdown must not kill the process

    debug = info = warning = error = critical = exception = log = msg


class _Forward(logging.Handler):
    """The standard library's log records, as this process's structlog lines."""

    def __init__(self, log: Any) -> None:
        super().__init__()
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.log(record.levelno, record.getMessage(), logger=record.name,
                         **({"exc_info": record.exc_info} if record.exc_info else {}))
        except Exception:  # a record that cannot be rendered must not take the process down
            self.handleError(record)


def role_logger(role: str) -> Any:
    """A library part's logger: the process's (setup_logging) bound to `role` in a serving process;
    offline, one that says nothing below warnings."""
    if structlog.is_configured():
        return structlog.get_logger().bind(role=role, pid=os.getpid())
    return structlog.wrap_logger(structlog.PrintLogger(), wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def setup_logging(role: str, cfg: LogConfig, **context: Any) -> structlog.typing.FilteringBoundLogger:
    """Configure structlog for this process and return a logger bound to role, pid and context."""
    streams: list[TextIO] = [sys.stderr] if cfg.stderr or not cfg.dir else []
    if cfg.dir:
        Path(cfg.dir).mkdir(parents=True, exist_ok=True)
        streams.append(open(Path(cfg.dir) / f"{role}.log", "a", buffering=1, encoding="utf-8"))
    level = logging.getLevelNamesMapping().get(cfg.level.upper())
    if level is None:
        raise ValueError(f"log.level: unknown level {cfg.level!r}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *_: _TeeLogger(streams),
        cache_logger_on_first_use=True,
    )
    log = structlog.get_logger().bind(role=role, pid=os.getpid(), **context)
    root = logging.getLogger()
    root.handlers[:] = [_Forward(log)]
    root.setLevel(level)
    logging.captureWarnings(True)
    return log


def summarize_ms(samples: Iterable[float]) -> dict[str, Any]:
    """Count, median, p90 and sum (in ms) of durations in seconds, for the stats replies."""
    ms = [x * 1000 for x in samples]
    return {"n": len(ms), "median_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90), "sum_ms": float(sum(ms))}


def server_marker(log_dir: str) -> Path:
    """The file a running launcher keeps in its log dir: {"pid", "started", "frontend_address", "http_address"}."""
    return Path(log_dir) / "server.json"


def process_started(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, Linux /proc): with the pid, a process's identity."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _running(log_dir: Path) -> bool:
    """Its launcher still runs: the marker's pid is alive and, where the marker says when it started, the
    same process (not a later one given the pid). Not by its command line: `python tools/launch.py` and
    `python -m orca_mq.cli serve` need not name orca-mq."""
    import json

    try:
        marker = json.loads(server_marker(str(log_dir)).read_text())
        started = process_started(int(marker["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return started is not None and marker.get("started", started) == started


def choose_log_dir(template: str) -> Path:
    """The log dir `orca-mq logs` reads when no port is named: the only running server's, else the most
    recently written one (said on stderr); several running servers is a one-line error."""
    if "{port}" not in template:
        return Path(template)
    import glob

    dirs = [Path(p) for p in glob.glob(template.replace("{port}", "*")) if Path(p).is_dir()]
    running = [d for d in dirs if _running(d)]
    if len(running) == 1:
        return running[0]
    if running:
        raise SystemExit(f"orca-mq logs: {len(running)} servers are running (ports {', '.join(sorted(d.name for d in running))}); "
                         "choose one with --port")
    written = [d for d in dirs if any(d.glob("*.log"))]
    if not written:
        raise SystemExit(f"orca-mq logs: no logs under {template.replace('{port}', '*')}")
    latest = max(written, key=lambda d: max(f.stat().st_mtime for f in d.glob("*.log")))
    print(f"orca-mq logs: no server is running; these are the logs of the last one (port {latest.name})", file=sys.stderr)
    return latest


def show_logs(log_dir: str, follow: bool, lines: int, raw: bool) -> None:
    """Print the last `lines` lines of every process's log merged by timestamp; `follow` keeps going."""
    import json
    import time

    def ts(line: str) -> str:
        try:
            return str(json.loads(line).get("ts", ""))
        except ValueError:
            return ""

    def pretty(line: str) -> str:
        try:
            rec = json.loads(line)
        except ValueError:
            return line
        head = f"{rec.pop('ts', '')} {rec.pop('role', '?'):<10} {rec.pop('level', ''):<7} {rec.pop('event', '')}"
        rec.pop("pid", None)
        return head + "".join(f" {k}={v}" for k, v in rec.items())

    files = {p: p.open(encoding="utf-8") for p in sorted(Path(log_dir).glob("*.log"))}
    if not files:
        sys.exit(f"no logs in {log_dir!r}")
    backlog = sorted((ts(line), line) for f in files.values() for line in f.read().splitlines())
    for _, line in backlog[-lines:] if lines > 0 else backlog:
        print(line if raw else pretty(line))
    while follow:
        for p in Path(log_dir).glob("*.log"):
            files.setdefault(p, p.open(encoding="utf-8"))
        for _, line in sorted((ts(line), line) for f in files.values() for line in f.read().splitlines()):
            print(line if raw else pretty(line), flush=True)
        time.sleep(0.5)
