"""Start and stop a real orca-mq server (tools/launch.py) for the serving tests.

Every server gets its own free TCP ports, ipc path and log dir, so tests never collide; stop()
ends the launcher and then, by pid, any child it left behind.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> dict[int, str]:
    """pid -> command line of the direct children of `pid`."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
    return out


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
    proc: subprocess.Popen[str]
    address: str
    log_dir: Path
    stderr_path: Path
    children: dict[int, str] = field(default_factory=dict)

    def pid_of(self, needle: str) -> int:
        return next(pid for pid, cmd in self.children.items() if needle in cmd)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid, cmd in self.children.items():
            if alive(pid) and self.address in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        return self.proc.returncode

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def start_server(tmp: Path, n_workers: int = 1, ready_timeout: float = 240.0, **overrides: object) -> Server:
    tmp.mkdir(parents=True, exist_ok=True)
    address = f"tcp://127.0.0.1:{free_port()}"
    sets = {
        "server.frontend_address": address,
        "server.backend_address": f"ipc://{tmp}/backend",
        "server.worker_base_port": free_port(),
        "engine.n_workers": n_workers,
        "engine.threads_per_worker": max(1, 2 // n_workers),
        "log.dir": str(tmp / "logs"),
        "server.http_address": "",   # no HTTP process unless a test asks for one (the default port is shared)
        **overrides,
    }
    cmd = [sys.executable, str(ROOT / "tools" / "launch.py")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    stderr_path = tmp / "launcher.stderr"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr_path.open("w"), text=True, cwd=tmp)
    server = Server(proc, address, tmp / "logs", stderr_path)
    deadline = time.monotonic() + ready_timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if "ready" in line:
                server.children = children_of(proc.pid)
                return server
    server.children = children_of(proc.pid)
    server.stop()
    raise RuntimeError(f"server did not become ready:\n{server.stderr()[-4000:]}")
