"""Processes: the one runner of a server's children, and `spawn()`, a whole server as a child.

The launcher starts every process of a server with `start_child`; tools, benchmarks and tests
start a whole server with `spawn` (the launcher in a process of its own, waited on until it
prints its ready line) and stop it with `ServerHandle.stop`.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn

from orca_mq.config import API_KEY_ENV, Config

ROOT = Path(__file__).resolve().parents[2]   # children import orca_mq, workers and kernels from here
READY_LINE = "orca-mq ready on "
ERROR_FILE_ENV = "ORCA_MQ_ERROR_FILE"   # where a child that fails writes its one-line reason for the launcher


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children_of(pid: int) -> dict[int, str]:
    """pid -> command line of the direct children of `pid` (Linux /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
    return out


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _die_with_parent() -> None:
    """Children get SIGTERM if their parent dies without stopping them (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass(slots=True)
class Child:
    role: str
    group: str                     # what restarts with it: "broker" (everything), "engine", or its own role
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)


def start_child(role: str, group: str, module: str, cfg: Config, error_file: Path, *extra: str) -> Child:
    """`python -m module --config-json ...` in its own session: a terminal's Ctrl-C reaches only the
    launcher, which then drains in order; the child's stdout goes to the launcher's stderr. The API keys
    go in the environment (readable by this user only), never on the command line (`ps` shows it to all)."""
    config = cfg.to_dict()
    config["server"]["api_key"] = ""
    cmd = [sys.executable, "-m", module, "--config-json", json.dumps(config), *extra]
    env = _env() | {API_KEY_ENV: cfg.server.api_key, ERROR_FILE_ENV: str(error_file)}
    if cfg.engine.omp_spin_count >= 0:   # libgomp reads it once, when torch loads it: hence here
        env["GOMP_SPINCOUNT"] = str(cfg.engine.omp_spin_count)
    if cfg.engine.malloc_top_pad >= 0:   # glibc reads it at the first malloc
        env["MALLOC_TOP_PAD_"] = str(cfg.engine.malloc_top_pad)
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_die_with_parent)
    return Child(role, group, proc)


def child_config(config_json: str) -> Config:
    """A child's config: the launcher's JSON, and the API keys from the environment."""
    cfg = Config.from_dict(json.loads(config_json))
    cfg.server.api_key = os.environ.get(API_KEY_ENV, "")
    return cfg


def run_logged(role: str, cfg: Config, body: Callable[[], int]) -> int:
    """Run a child's `body`; if it raises, the traceback goes to its log, one line to the launcher
    (ERROR_FILE_ENV), nothing to the terminal, and the exit status is 1."""
    from orca_mq.logs import setup_logging

    log = setup_logging(role, cfg.log)
    try:
        return body()
    except Exception as e:
        log.exception("process failed", error=str(e)[:500])
        if path := os.environ.get(ERROR_FILE_ENV):
            with contextlib.suppress(OSError):
                Path(path).write_text(one_line(e))
        return 1


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def stop_children(children: list[Child], grace: float) -> None:
    """SIGTERM all, then SIGKILL whoever is still alive after `grace` seconds."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


@dataclass(slots=True)
class ServerHandle:
    """A server started by `spawn`: its launcher process, client address and launcher stderr."""

    proc: subprocess.Popen[str]
    address: str
    stderr_path: Path
    ready_line: str = ""

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (drain), wait; SIGKILL the launcher's whole process group past `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def children(self) -> dict[int, str]:
        """The launcher's processes now (supervision replaces them): pid -> command line."""
        return children_of(self.proc.pid)

    def pid_of(self, needle: str) -> int:
        """The pid of the launcher's child whose command line contains `needle`."""
        return next(pid for pid, cmd in self.children().items() if needle in cmd)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""


def spawn(sets: Mapping[str, Any], stderr_path: Path, *, config: str | None = None, ready_timeout: float = 600.0,
          cwd: Path | None = None, env: Mapping[str, str] | None = None) -> ServerHandle:
    """Start `orca-mq serve --set k=v ...` (the installed module, `python -m orca_mq.cli`: nothing of the
    tools folder) and return once it prints its ready line; `env` adds to (and only it may set the API
    key of) the environment it starts in.
    Raises RuntimeError (with the tail of its stderr) if it exits or is not ready in time."""
    cmd = [sys.executable, "-u", "-m", "orca_mq.cli", "serve", *(["--config", config] if config else [])]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    stderr_path.parent.mkdir(parents=True, exist_ok=True)
    err: IO[str] = stderr_path.open("w")
    err.write("# " + " ".join(cmd) + "\n")
    err.flush()
    base = {k: v for k, v in _env().items() if k != API_KEY_ENV}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
                            cwd=cwd or ROOT, env=base | {"PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
    err.close()
    handle = ServerHandle(proc, str(sets.get("server.frontend_address", "")), stderr_path)
    assert proc.stdout is not None
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if line.startswith(READY_LINE):
                handle.ready_line = line.strip()
                handle.address = line[len(READY_LINE):].split()[0]
                return handle
    handle.stop()
    raise RuntimeError(f"server not ready (exit code {proc.returncode}); its stderr ends:\n{handle.stderr()[-4000:]}")


def process_main(role: str, description: str, run: Callable[[Config, argparse.Namespace], Coroutine[Any, Any, int]],
                 *options: tuple[str, dict[str, Any]]) -> None:
    """The entry point of every asyncio process the launcher starts: `--config-json` (and `options`)
    in, `run(cfg, args)` on uvloop, its result as the exit status (run_logged)."""
    import uvloop

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config-json", required=True)
    for flag, kwargs in options:
        parser.add_argument(flag, **kwargs)
    args = parser.parse_args()
    cfg = child_config(args.config_json)
    exit_now(run_logged(role, cfg, lambda: uvloop.run(run(cfg, args))))


def exit_now(code: int) -> NoReturn:
    """Exit with `code`, stdout and stderr flushed, without the interpreter's teardown (a collection of
    every module's objects: a quarter of a second a process, on every stop and restart): for a process
    whose sockets are closed and whose logs are written line by line."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
