"""The launcher: starts every process of a server, supervises them, drains and stops them.

Start: the broker and the workers, then the scheduler and the frontend; once every one reports
`ready` it prints `orca-mq ready on <frontend_address> and http://<http_address>` on stdout (progress goes to stderr).
Supervision (systemd's `Restart=on-failure` with a start limit, torchrun's elastic restarts):
- a worker, the scheduler or the frontend dies: the broker gives every in-flight request an
  `error` final and answers new ones `unavailable` at once, while the launcher restarts that
  engine side (frontend, scheduler, workers); then the broker serves again (`resume`);
- the broker dies: everything restarts on the same addresses; clients see the new broker's
  identity in its pong and end their open streams with an error;
- more than `server.max_restarts` restarts within `server.restart_window` seconds: a crash
  loop, the launcher stops everything and exits with status 1.
Many hosts (orca_mq/server/nodes.py): the launcher runs once per node; node 0 runs everything above
and its share of the workers, the others only theirs (node_launcher.py). There a dead process or
node fails the in-flight requests and stops the server (exit 1): workers on other hosts are not
restarted from here.
SIGINT/SIGTERM: drain (new requests refused, in-flight ones may finish for `server.drain_timeout`
seconds, then aborted), stop every child, exit 0. A second signal stops at once. During start-up a
signal stops every child and exits 128 + its number (130 for Ctrl-C): the server never served.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import zmq

from orca_mq.config import Config
from orca_mq.models.files import EMBEDDED_FILE
from orca_mq.kv.pool import sized_at_start
from orca_mq.logs import process_started, server_marker, setup_logging, tell
from orca_mq.protocol import ProtocolError, decode
from orca_mq.protocol.client_msgs import Error, Ping, Pong
from orca_mq.protocol.codec import channel
from orca_mq.protocol.control_msgs import AbortAll, Drain, Drained, Fatal, Progress, Ready, Resume
from orca_mq.runtime.device import uses_cuda
from orca_mq.runtime.placement import placement
from orca_mq.server.nodes import STOPPED, NodeError, NodeGroup, resolve_addresses, uses_store, worker_name
from orca_mq.server.process import READY_LINE, Child, free_port, start_child, stop_children
from orca_mq.server.zmq_queue import SyncBrokerLink

ACCEPTED = channel(Ready, Progress, Drained, Pong, Error)
POLL = 0.2
_WHAT = {"broker": "the whole server", "engine": "the engine side", "http": "the HTTP API"}


class StartupError(RuntimeError):
    """A process died or did not report ready in time while (re)starting."""


class Launcher:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.node_rank = cfg.server.node_rank
        self.log = setup_logging(f"launcher{self.node_rank or ''}", cfg.log)
        self.run_dir = tempfile.mkdtemp(prefix="orca_mq-")  # private control and backend sockets
        if not cfg.server.backend_address:
            cfg.server.backend_address = f"ipc://{self.run_dir}/backend"
        resolve_addresses(cfg)  # many hosts: the broker's backend over TCP
        self.nodes: NodeGroup | None = None
        self.children: list[Child] = []
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.link: SyncBrokerLink | None = None
        self.signals = 0
        self.first_signal = 0
        self.restarts: deque[float] = deque()
        self.n_restarts = 0
        self.pings = 0    # the last ping's nonce
        self.early: deque[Any] = deque()   # messages that came while a ping waited for its pong
        self.t0 = time.monotonic()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        # a signal wakes the launcher's poll at once (a child's death too, by SIGCHLD): a stop and a
        # restart begin then, not at the poll's next timeout
        self.wake_fd, wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals += 1
        self.first_signal = self.first_signal or signum
        self.log.info("signal received", signal=signal.Signals(signum).name)

    def say(self, text: str) -> None:
        """Human-readable lines on the terminal (failures, restarts); the JSON logs stay in log.dir."""
        tell(self.t0, text)

    def progress(self, text: str) -> None:
        """A start-up step on the terminal, unless log.progress is off."""
        if self.cfg.log.progress:
            self.say(text)

    def run(self) -> int:
        marker = server_marker(self.cfg.log.dir)
        try:
            if self.cfg.log.dir:  # `orca-mq logs` finds the running servers by it
                marker.write_text(json.dumps({"pid": os.getpid(), "started": process_started(os.getpid()),
                                              "frontend_address": self.cfg.server.frontend_address,
                                              "http_address": self.cfg.server.http_address}))
            self._start("broker")
            print(self._ready_line(), flush=True)
            return self._supervise()
        except StartupError as e:
            self.log.error("start-up failed", error=str(e))
            self.say(f"error: {e}")
            return 128 + self.first_signal if self.signals else 1   # interrupted before serving: 130 for Ctrl-C
        except NodeError as e:
            self.log.error("nodes failed to meet", error=str(e))
            self.say(f"error: {e}")
            return 128 + self.first_signal if self.signals else 1
        finally:
            if self.nodes is not None and self.node_rank == 0:
                self.nodes.report(STOPPED)
            stop_children([c for c in self.children if c.role != "broker"], self.cfg.server.stop_grace)
            stop_children([c for c in self.children if c.role == "broker"], self.cfg.server.stop_grace)
            self.log.info("stopped", exit_codes={c.role: c.proc.returncode for c in self.children})
            if self.link is not None:
                self.link.close()
            self.ctx.term()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            marker.unlink(missing_ok=True)

    # ------------------------------------------------------------ start

    def _ready_line(self) -> str:
        """`orca-mq ready on tcp://H:P`, and ` and http://H:P` when the HTTP API runs."""
        http = self.cfg.server.http_address
        return f"{READY_LINE}{self.cfg.server.frontend_address}" + (f" and http://{http}" if http else "")

    def _spawn(self, role: str, group: str, module: str, *extra: str) -> None:
        error_file = self._error_file(role)
        error_file.unlink(missing_ok=True)
        self.children.append(start_child(role, group, module, self.child_cfg, error_file, *extra))
        self.log.info("started", child=role, child_pid=self.children[-1].proc.pid, restarts=self.n_restarts)

    def _error_file(self, role: str) -> Path:
        return Path(self.run_dir) / f"{role}.error"

    def _why(self, dead: list[Child]) -> str:
        """What died and why, in one line: each child's own one-line reason, else its exit status."""
        def reason(c: Child) -> str:
            try:
                return f"{c.role}: {self._error_file(c.role).read_text()}"
            except OSError:
                return f"{c.role} exited with status {c.proc.returncode}"

        return "; ".join(map(reason, dead))

    def _start(self, group: str) -> None:
        """Start `group` and wait for it: "broker", everything; "engine", the frontend, the scheduler and
        the workers; "http", the HTTP API process (a client of the broker like any other)."""
        self.child_cfg = copy.deepcopy(self.cfg)
        # `auto` decided once, here: the processes that do not compute (the scheduler) would import torch to ask
        self.child_cfg.engine.device = "cuda" if uses_cuda(self.cfg.engine.device) else "cpu"
        if not self.cfg.server.worker_base_port:  # a fresh rendezvous port: the last one may linger
            self.child_cfg.server.worker_base_port = free_port()
        if group != "http" and uses_store(self.child_cfg):  # host the rendezvous before anything looks for it
            self.nodes = None  # a restart's new store may take the old one's port: close that first
            self.nodes = NodeGroup.open(self.child_cfg)
        deadline = time.monotonic() + self.cfg.server.ready_timeout
        if group == "broker":
            self._spawn("broker", "broker", "orca_mq.server.broker", "--restarts", str(self.n_restarts))
            if self.link is None:
                self.link = SyncBrokerLink(self.ctx, self.cfg.server.backend_address, "launcher", self.wake_fd)
        waiting: set[str] = set()
        workers: set[str] = set()
        loading = 0.0   # when the workers started
        if group in ("broker", "engine"):
            if self.nodes is not None:
                self.nodes.join(self.log, lambda: self.signals > 0)
            workers, loading = self._spawn_workers(), time.monotonic()
            waiting |= workers
        if group == "broker":   # the workers import torch meanwhile (seconds); they report through the broker
            while not self._ping(timeout=1.0):
                self._check_startup(deadline, "the broker")
        if group in ("broker", "http") and self.cfg.server.http_address:
            self._spawn("http", "http", "orca_mq.api.server")
            waiting.add("http")
        if group in ("broker", "engine"):
            if sized_at_start(self.child_cfg):   # the workers size the KV pool: the others start knowing it
                slots = self._wait(waiting, workers, loading, deadline, until=workers)
                self.child_cfg.engine.n_slots = min(slots.values())
                self.log.info("KV pool sized by the workers", slots=slots)
            self._spawn("scheduler", "engine", "orca_mq.server.scheduler_process", "--run-dir", self.run_dir)
            self._spawn("frontend", "engine", "orca_mq.server.frontend")
            waiting |= {"frontend", "scheduler"}
        self._wait(waiting, workers, loading, deadline)
        self._resume()

    def _wait(self, waiting: set[str], workers: set[str], loading: float, deadline: float,
              until: set[str] | None = None) -> dict[str, int]:
        """Take `ready` reports off `waiting` until `until` (default: all of it) is empty; the workers'
        KV pools, by name."""
        until = waiting if until is None else until
        slots: dict[str, int] = {}
        while until & waiting:
            self._check_startup(deadline, ", ".join(sorted(waiting)))
            msg = self._recv(POLL)
            if isinstance(msg, Progress):
                self.progress(f"{msg.role}: {msg.what}")
            elif isinstance(msg, Ready) and msg.role in waiting:
                waiting.discard(msg.role)
                if msg.role not in workers:
                    self.progress(f"{msg.role} ready")
                else:
                    slots[msg.role] = msg.kv_slots
                    if not waiting & workers:   # one line for the model, however many workers load it
                        self.progress(f"model loaded in {time.monotonic() - loading:.1f} s")
        return slots

    def _spawn_workers(self) -> set[str]:
        """This node's workers: its share of the stages x TP ranks, in placement order; their names."""
        tp, names = self.cfg.engine.tp_size, set()
        here = [r for r, node in enumerate(placement(self.cfg.engine.n_workers, tp, self.cfg.server.nnodes)) if node == self.node_rank]
        model = Path(self.cfg.model.path).name if self.cfg.model.path else EMBEDDED_FILE
        self.progress(f"loading the model {model} in {len(here)} worker{'s' * (len(here) > 1)}"
                      + (" (restart)" if self.n_restarts else ""))
        for rank in here:
            stage, tp_rank = divmod(rank, tp)
            names.add(worker_name(stage, tp_rank))
            self._spawn(worker_name(stage, tp_rank), "engine", "workers.main", "--stage", str(stage),
                        "--tp-rank", str(tp_rank), "--run-dir", self.run_dir)
        return names

    def _dead_nodes(self) -> list[str]:
        return self.nodes.poll() if self.nodes is not None and self.cfg.server.nnodes > 1 else []

    def _check_startup(self, deadline: float, what: str) -> None:
        if lost := self._dead_nodes():
            raise StartupError(f"{', '.join(lost)} failed during start-up")
        if dead := self._dead():
            raise StartupError(f"{self._why(dead)} (during start-up; details in {self.cfg.log.dir})")
        if self.signals:
            raise StartupError("interrupted during start-up")
        if time.monotonic() > deadline:
            raise StartupError(f"{what} not ready after server.ready_timeout = {self.cfg.server.ready_timeout:g} s")

    # ------------------------------------------------------------ supervise

    def _supervise(self) -> int:
        while not self.signals:
            lost, dead = self._dead_nodes(), self._dead()
            if lost or (dead and self.cfg.server.nnodes > 1):
                what = ", ".join(lost + [f"{c.role} (exit {c.proc.returncode})" for c in dead])
                self.log.error("a node or process died; stopping (other hosts' workers are not restarted)", died=what)
                self.say(f"error: {what} died; stopping")
                self._fail_in_flight(what)
                return 1
            if dead:
                if not self._restart(dead):
                    return 1
                continue
            self._recv(POLL)
        return self._drain()

    def _restart(self, dead: list[Child]) -> bool:
        """Fail what was in flight, restart what `dead` takes down with it, again while a restart fails to
        start; False on a crash loop."""
        while True:
            now = time.monotonic()
            self.restarts.append(now)
            while self.restarts and now - self.restarts[0] > self.cfg.server.restart_window:
                self.restarts.popleft()
            roles = ", ".join(f"{c.role} (exit {c.proc.returncode})" for c in dead)
            group = next(g for g in ("broker", "engine", "http") if any(c.group == g for c in dead))
            if len(self.restarts) > self.cfg.server.max_restarts:
                self.log.error("crash loop: giving up", died=roles, restarts=len(self.restarts),
                               window_s=self.cfg.server.restart_window)
                self.say(f"error: crash loop ({len(self.restarts)} restarts in {self.cfg.server.restart_window:g} s; "
                         f"last: {roles} died); stopping")
                if group == "engine":
                    self._fail_in_flight(roles)
                return False
            self.n_restarts += 1
            self.log.error("a process died; restarting", died=roles, why=self._why(dead), group=group, restarts=self.n_restarts)
            self.say(f"{roles} died: restarting {_WHAT[group]}")
            if group == "engine":
                self._fail_in_flight(roles)
            gone = [c for c in self.children if group == "broker" or c.group == group]
            stop_children(gone, self.cfg.server.stop_grace)
            self.children = [c for c in self.children if c not in gone]
            try:
                self._start(group)
            except StartupError as e:
                self.say(f"restart failed: {e}")
                if self.signals:
                    return True   # stopping anyway: _supervise drains
                dead = self._dead() or gone[:1]
                continue
            self.say(f"serving again (restart {self.n_restarts})")
            return True

    def _resume(self) -> None:
        """Every process is ready: the broker serves (it refused requests until now, as a frontend may
        be up before its scheduler). The pong means it did: a client that reads the ready line is served."""
        assert self.link is not None
        self.link.to_broker(Resume(self.n_restarts))  # also how the broker counts restarts for the metrics
        self._ping(timeout=2.0)

    def _fail_in_flight(self, reason: str) -> None:
        """The broker answers every in-flight request with an error and new ones `unavailable`."""
        assert self.link is not None
        self.link.to_broker(Fatal(reason))
        self._ping(timeout=2.0)  # the broker handles frames in order: the pong means it sent the errors

    def _drain(self) -> int:
        assert self.link is not None
        self.say("draining")
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

    def _dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def _ping(self, timeout: float) -> bool:
        """The broker answered this ping (not an earlier one's late pong): it handled every frame before it."""
        assert self.link is not None
        self.pings += 1
        self.link.to_broker(Ping(self.pings))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self._read(left)
            if isinstance(msg, Pong):
                if msg.nonce == self.pings:
                    return True
            elif msg is not None:   # a worker's report that came first: kept for whoever waits for it
                self.early.append(msg)
        return False

    def _recv(self, timeout: float) -> Any:
        return self.early.popleft() if self.early else self._read(timeout)

    def _read(self, timeout: float) -> Any:
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
