"""The launcher: starts every process of a server, watches them, drains and stops them.

`tools/launch.py` (and the `orca-mq serve` command) run it. It starts the broker, the workers, the scheduler and the frontend, and prints one line
`orca-mq ready on <frontend_address>` on stdout once every process has reported ready.
SIGINT/SIGTERM: drain (new requests are refused; in-flight ones may finish for
`server.drain_timeout` seconds, then are aborted), stop every child, exit 0.
If a child dies: the broker sends every in-flight request an `error` final message, the other
children are stopped, and the launcher exits with status 1.
Many hosts (orca_mq/server/nodes.py): the launcher runs once per node; node 0 runs everything above
and its share of the workers, the others only their workers. A node that dies counts as a dead child.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from orca_mq.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]   # children import orca_mq, workers and kernels from here
from orca_mq.logs import setup_logging
from orca_mq.protocol import ProtocolError, decode
from orca_mq.protocol.client_msgs import Error, Ping, Pong
from orca_mq.protocol.codec import channel
from orca_mq.protocol.control_msgs import AbortAll, Drain, Drained, Fatal, Ready
from orca_mq.server.nodes import STOPPED, NodeError, NodeGroup, placement, resolve_addresses, uses_store, worker_name
from orca_mq.server.zmq_queue import SyncBrokerLink

ACCEPTED = channel(Ready, Drained, Pong, Error)
STOP_GRACE = 10.0     # seconds a child gets after SIGTERM before SIGKILL
POLL = 0.2


def _die_with_parent() -> None:
    """Children get SIGTERM if the launcher dies without stopping them (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass(slots=True)
class Child:
    role: str
    proc: subprocess.Popen[bytes]


class Launcher:
    def __init__(self, cfg: Config) -> None:
        resolve_addresses(cfg)
        self.cfg = cfg
        self.node_rank = cfg.server.node_rank
        self.log = setup_logging(f"launcher{self.node_rank or ''}", cfg.log)
        self.nodes: NodeGroup | None = None
        self.run_dir = tempfile.mkdtemp(prefix="orca_mq-")
        self.children: list[Child] = []
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.link: SyncBrokerLink | None = None
        self.signals = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals += 1
        self.log.info("signal received", signal=signal.Signals(signum).name)

    def _spawn(self, role: str, module: str, *extra: str) -> None:
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", module, "--config-json", json.dumps(self.cfg.to_dict()), *extra]
        # own session: a terminal's Ctrl-C reaches only the launcher, which then drains in order
        proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, start_new_session=True, preexec_fn=_die_with_parent)
        self.children.append(Child(role, proc))
        self.log.info("started", child=role, child_pid=proc.pid)

    def run(self) -> int:
        try:
            if not self._start():
                return 1 if self.signals == 0 else 0
            print(self._ready_line(), flush=True)
            return self._supervise()
        except NodeError as e:
            self.log.error("nodes failed to meet", error=str(e))
            print(f"orca-mq: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            if self.nodes is not None and self.node_rank == 0:
                self.nodes.report(STOPPED)
            self._stop_children()
            if self.link is not None:
                self.link.close()
            self.ctx.term()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _start(self) -> bool:
        if uses_store(self.cfg):  # host the rendezvous before anything can look for it
            self.nodes = NodeGroup.open(self.cfg)
        self._spawn("broker", "orca_mq.server.broker")
        self.link = SyncBrokerLink(self.ctx, self.cfg.server.backend_address, "launcher")
        deadline = time.monotonic() + self.cfg.server.ready_timeout
        while not self._ping(timeout=1.0):
            if self._dead() or self.signals or time.monotonic() > deadline:
                self.log.error("broker did not come up")
                return False
        if self.nodes is not None:
            self.nodes.join(self.log, lambda: self.signals > 0)
        self._spawn_workers()
        self._spawn("scheduler", "orca_mq.server.scheduler_process", "--run-dir", self.run_dir)
        self._spawn("frontend", "orca_mq.server.frontend")
        tp = self.cfg.engine.tp_size
        waiting = {"frontend", "scheduler", *(worker_name(*divmod(r, tp)) for r in range(self.cfg.engine.n_workers * tp))}
        while waiting:
            if dead := self._dead() + self._dead_nodes():
                self.log.error("a process died during startup", processes=dead)
                return False
            if self.signals or time.monotonic() > deadline:
                self.log.error("startup interrupted", waiting=sorted(waiting), signals=self.signals)
                return False
            msg = self._recv(POLL)
            if isinstance(msg, Ready):
                waiting.discard(msg.role)
                self.log.info("ready", child=msg.role, child_pid=msg.pid)
        return True

    def _ready_line(self) -> str:
        return f"orca-mq ready on {self.cfg.server.frontend_address}"

    def _supervise(self) -> int:
        while not self.signals:
            if dead := self._dead() + self._dead_nodes():
                return self._fail(dead)
            self._recv(POLL)
        return self._drain()

    def _drain(self) -> int:
        assert self.link is not None
        self.log.info("draining", timeout=self.cfg.server.drain_timeout)
        self.link.to_peer("frontend", Drain())
        if not self._wait_drained(self.cfg.server.drain_timeout):
            self.link.to_peer("frontend", AbortAll("server shutting down: drain timeout"))
            self._wait_drained(5.0)
        return 0

    def _wait_drained(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.signals < 2 and not self._dead():
            if isinstance(self._recv(POLL), Drained):
                return True
        return False

    def _fail(self, dead: list[str]) -> int:
        assert self.link is not None
        reason = f"{', '.join(dead)} died"
        self.log.error("a process died; failing in-flight requests and stopping", processes=dead)
        if "broker" not in " ".join(dead):
            self.link.to_broker(Fatal(reason))
            self._ping(timeout=2.0)  # the broker handles frames in order: the pong means it sent the errors
        return 1

    # ------------------------------------------------------------ many hosts: placement and spawning

    def _spawn_workers(self) -> None:
        """This node's workers: its share of the stages x TP ranks, in placement order."""
        tp = self.cfg.engine.tp_size
        for rank, node in enumerate(placement(self.cfg.engine.n_workers, tp, self.cfg.server.nnodes)):
            if node == self.node_rank:
                stage, tp_rank = divmod(rank, tp)
                self._spawn(worker_name(stage, tp_rank), "workers.main", "--stage", str(stage),
                            "--tp-rank", str(tp_rank), "--run-dir", self.run_dir)

    def _dead_nodes(self) -> list[str]:
        return self.nodes.poll() if self.nodes is not None else []

    def _dead(self) -> list[str]:
        return [f"{c.role} (pid {c.proc.pid}, exit {c.proc.returncode})" for c in self.children if c.proc.poll() is not None]

    def _ping(self, timeout: float) -> bool:
        assert self.link is not None
        self.link.to_broker(Ping(0))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if isinstance(self._recv(left), Pong):
                return True
        return False

    def _recv(self, timeout: float) -> Any:
        assert self.link is not None
        env = self.link.recv(timeout)
        if env is None:
            return None
        try:
            msg = decode(env.payload, ACCEPTED)
        except ProtocolError as e:
            self.log.warning("rejected frame", error=str(e))
            return None
        if isinstance(msg, Error):
            self.log.warning("error from a process", error=msg.error)
        return msg

    def _stop_children(self) -> None:
        """Frontend, scheduler and workers first, the broker last, so final messages get out."""
        for group in ([c for c in self.children if c.role != "broker"], [c for c in self.children if c.role == "broker"]):
            for c in group:
                if c.proc.poll() is None:
                    c.proc.terminate()
            deadline = time.monotonic() + STOP_GRACE
            for c in group:
                try:
                    c.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.log.warning("killing unresponsive process", child=c.role, child_pid=c.proc.pid)
                    c.proc.kill()
                    c.proc.wait()
        self.log.info("stopped", exit_codes={c.role: c.proc.returncode for c in self.children})


def show_logs(cfg: Config, follow: bool, lines: int, raw: bool) -> None:
    """Print the last `lines` lines of every process's log merged by timestamp; -f keeps following."""
    files = {p: p.open(encoding="utf-8") for p in sorted(Path(cfg.log.dir).glob("*.log"))}
    if not files:
        sys.exit(f"no logs in {cfg.log.dir!r}")
    backlog = sorted((_ts(line), line) for f in files.values() for line in f.read().splitlines())
    for _, line in backlog[-lines:] if lines > 0 else backlog:
        print(line if raw else _pretty(line))
    while follow:
        for p in Path(cfg.log.dir).glob("*.log"):
            files.setdefault(p, p.open(encoding="utf-8"))
        fresh = sorted((_ts(line), line) for f in files.values() for line in f.read().splitlines())
        for _, line in fresh:
            print(line if raw else _pretty(line), flush=True)
        time.sleep(0.5)


def _ts(line: str) -> str:
    try:
        return str(json.loads(line).get("ts", ""))
    except ValueError:
        return ""


def _pretty(line: str) -> str:
    try:
        rec = json.loads(line)
    except ValueError:
        return line
    head = f"{rec.pop('ts', '')} {rec.pop('role', '?'):<10} {rec.pop('level', ''):<7} {rec.pop('event', '')}"
    rec.pop("pid", None)
    return head + "".join(f" {k}={v}" for k, v in rec.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["serve", "logs"], default="serve")
    parser.add_argument("--config", default=None, help="config.toml (default: the repo's)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    parser.add_argument("-f", "--follow", action="store_true", help="logs: keep printing new lines")
    parser.add_argument("-n", "--lines", type=int, default=200, help="logs: last N lines (0 = all)")
    parser.add_argument("--json", action="store_true", help="logs: print the raw JSON lines")
    for flag, key in _NODE_FLAGS.items():  # torchrun-style shorthands of the [server] keys
        parser.add_argument(flag, dest=key, default=None, metavar=flag[2:].upper(), help=f"= --set {key}=...")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.set + [f"{k}={v}" for k in _NODE_FLAGS.values() if (v := getattr(args, k)) is not None])
    if args.command == "logs":
        try:
            show_logs(cfg, args.follow, args.lines, args.json)
        except KeyboardInterrupt:
            pass
        return 0
    if cfg.server.node_rank == 0:
        return Launcher(cfg).run()
    from orca_mq.server.node_launcher import NodeLauncher  # it subclasses Launcher

    return NodeLauncher(cfg).run()


_NODE_FLAGS = {"--nnodes": "server.nnodes", "--node-rank": "server.node_rank",
               "--master-addr": "server.master_addr", "--master-port": "server.worker_base_port"}


if __name__ == "__main__":
    sys.exit(main())
