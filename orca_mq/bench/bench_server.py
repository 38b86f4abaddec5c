"""A server a benchmark starts and is sure to stop: `Server` spawns one on a free port for a `with`
block; `on_sigterm`, installed as the SIGTERM handler, turns a terminate into KeyboardInterrupt so
that the benchmark's `finally` (or `with`) stops what it started."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from orca_mq.server.process import ServerHandle, free_port, spawn


def on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Server:
    """One server (`spawn`) on a free port, stopped with SIGTERM."""

    def __init__(self, workers: int, threads: int, max_bs: int, extra: list[str]) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="orca_mq_bench-"))
        self.sets = {"server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "engine.n_workers": workers,
                     "engine.threads_per_worker": threads, "scheduler.max_bs": max_bs, "log.dir": f"{self.tmp}/logs",
                     "log.level": "warning", "server.http_address": "",  # ZeroMQ only: no HTTP process on the shared port
                     **dict(item.split("=", 1) for item in extra)}

    def __enter__(self) -> ServerHandle:
        self.handle = spawn(self.sets, self.tmp / "launcher.stderr", ready_timeout=300)
        return self.handle

    def __exit__(self, *exc: object) -> None:
        self.handle.stop(60)
