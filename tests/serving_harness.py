"""Start and stop a real orca-mq server (tools/launch.py through `spawn`) for the serving tests.

Every server gets its own free TCP port, log dir and (the launcher's own) private backend socket,
so tests never collide; stop() ends the launcher and then, by pid, any child it left behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from orca_mq.client import Client

from orca_mq.server.process import ROOT, ServerHandle, children_of, free_port, spawn

__all__ = ["ROOT", "Server", "alive", "children_of", "free_port", "openai_client", "settled", "start_server"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; only its parent's wait is missing
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Server:
    """A server from `orca_mq.server.process.spawn`, with what the tests look at: its processes by
    command line (the launcher's children, read afresh: supervision replaces them) and its logs."""

    handle: ServerHandle
    log_dir: Path

    @property
    def proc(self) -> subprocess.Popen[str]:
        return self.handle.proc

    @property
    def address(self) -> str:
        return self.handle.address

    @property
    def children(self) -> dict[int, str]:
        return self.handle.children()

    def pid_of(self, needle: str) -> int:
        return self.handle.pid_of(needle)

    def stop(self, timeout: float = 30.0) -> int | None:
        children = self.children
        code = self.handle.stop(timeout)
        for pid in children:  # whatever the launcher left behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        return code

    def stderr(self) -> str:
        return self.handle.stderr()


def start_server(tmp: Path, n_workers: int = 1, ready_timeout: float = 240.0, env: dict[str, str] | None = None,
                 **overrides: object) -> Server:
    tmp.mkdir(parents=True, exist_ok=True)
    sets = {
        "server.frontend_address": f"tcp://127.0.0.1:{free_port()}",
        "engine.n_workers": n_workers,
        "engine.threads_per_worker": max(1, 2 // n_workers),
        "log.dir": str(tmp / "logs"),
        "server.http_address": "",   # no HTTP process unless a test asks for one (the default port is shared)
        "model.dtype": "float32",    # exactness is judged in fp32; the default (auto) is bf16 on some CPUs
        **overrides,
    }
    return Server(spawn(sets, tmp / "launcher.stderr", ready_timeout=ready_timeout, cwd=tmp, env=env), tmp / "logs")


def openai_client(base_url: str, api_key: str = "unused", timeout: float = 120) -> openai.OpenAI:
    """The official client on a test server's HTTP API (`base_url` without /v1), never retrying."""
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


def settled(address: str, timeout: float = 30.0, api_key: str | None = None) -> dict[str, Any]:
    """The server's stats once no request is active anywhere and no KV slot is held."""
    deadline = time.monotonic() + timeout
    with Client(address, api_key=api_key) as client:
        while True:
            stats = client.stats()
            if (stats["frontend"]["active_requests"] == 0 and stats["scheduler"]["used_slots"] == 0
                    and stats["broker"]["tracked_requests"] == 0):
                return stats
            assert time.monotonic() < deadline, f"requests or KV slots still held: {stats}"
            time.sleep(0.2)
