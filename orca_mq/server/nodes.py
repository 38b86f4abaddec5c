"""Workers on many hosts: names and the launchers' rendezvous and liveness (which node runs which
worker: orca_mq/runtime/placement.py).

The launcher runs once per node, torchrun-style (`--nnodes N --node-rank R --master-addr HOST
--master-port PORT`). Node 0's launcher hosts a TCP store at HOST:PORT: the launchers meet there,
the workers' torch.distributed rendezvous runs on it (workers/data_plane.py), and workers publish
the TCP addresses of their control sockets when their upstream sits on another node. Every other
node's launcher adds to a heartbeat counter 4 times per `server.node_timeout` and watches a stop key; node 0 declares
a node dead when its counter stalls for `server.node_timeout` seconds, or when that node reports
a dead child, and then fails every in-flight request like any other process death.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from orca_mq.config import Config
from orca_mq.runtime.placement import placement

if TYPE_CHECKING:
    import torch.distributed as dist

RENDEZVOUS = "launch/rendezvous"
STOP = "launch/stop"
STOPPED = "node 0 stopped"


class NodeError(RuntimeError):
    pass


def worker_name(stage: int, tp_rank: int) -> str:
    """Rank 0 keeps the plain stage name: the scheduler's stats queries address stages by it."""
    return f"worker{stage}" if tp_rank == 0 else f"worker{stage}.{tp_rank}"


def check_gpus(cfg: Config, cuda_devices: Callable[[], int] | None = None) -> None:
    """Refuse, before anything starts, more workers on this node than its CUDA devices while the
    engine runs on CUDA: every worker takes a GPU of its own (runtime/device.py worker_device), and
    two ranks on one GPU die inside NCCL ("Duplicate GPU detected") after a minute of loading.
    `cuda_devices` stands in for torch's count (tests); torch is imported only when it decides."""
    e = cfg.engine
    if e.device == "cpu":
        return
    try:
        here = placement(e.n_workers, e.tp_size, cfg.server.nnodes).count(cfg.server.node_rank)
    except ValueError:   # a layout that cannot be placed is reported where the nodes start
        return
    if e.device == "auto" and here <= 1:
        return
    count = (cuda_devices or _cuda_devices)()
    if e.device == "auto" and count == 0:   # auto without CUDA runs on the CPU
        return
    if here > count:
        raise ValueError(f"{here} worker{'s' * (here > 1)} on this node (engine.n_workers={e.n_workers} x "
                         f"engine.tp_size={e.tp_size} over {cfg.server.nnodes} node(s)) but {count} CUDA device(s): "
                         "each worker needs a GPU of its own; use fewer workers, more nodes or engine.device=cpu")


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def uses_store(cfg: Config) -> bool:
    return cfg.server.nnodes > 1 or cfg.engine.n_workers * cfg.engine.tp_size > 1


def resolve_addresses(cfg: Config) -> None:
    """Across hosts the workers reach node 0's broker over TCP: an ipc backend becomes master:port+1."""
    if cfg.server.nnodes > 1 and cfg.server.backend_address.startswith("ipc://"):
        cfg.server.backend_address = f"tcp://{cfg.server.master_addr}:{cfg.server.worker_base_port + 1}"


def connect_store(cfg: Config, is_master: bool = False) -> "dist.TCPStore":
    import torch.distributed as dist  # only a launcher that hosts or joins a rendezvous pays for torch

    s = cfg.server
    try:
        return dist.TCPStore(s.master_addr, s.worker_base_port, is_master=is_master, wait_for_workers=False,
                             timeout=timedelta(seconds=s.ready_timeout))
    except (RuntimeError, OSError) as e:
        where = "host" if is_master else "reach node 0's"
        raise NodeError(f"cannot {where} rendezvous at {s.master_addr}:{s.worker_base_port} "
                        f"within server.ready_timeout={s.ready_timeout:g}s: {e}") from e


def local_ip(cfg: Config) -> str:
    """The address of this host's interface towards node 0 (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((cfg.server.master_addr, cfg.server.worker_base_port))
        return str(s.getsockname()[0])


@dataclass(slots=True)
class NodeGroup:
    """One launcher's view of the others, over the TCP store (node 0 hosts it)."""

    cfg: Config
    store: dist.TCPStore
    rank: int
    nnodes: int
    _last_beat: float = 0.0
    _seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # node -> (counter, when it last moved)

    @classmethod
    def open(cls, cfg: Config) -> "NodeGroup":
        rank = cfg.server.node_rank
        return cls(cfg, connect_store(cfg, is_master=rank == 0), rank, cfg.server.nnodes)

    def join(self, log: Any, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Every node announces itself; node 0 waits `ready_timeout` for all, then tells each the outcome."""
        timeout = self.cfg.server.ready_timeout
        if self.rank != 0:
            self.store.set(f"launch/node{self.rank}", socket.gethostname())
            outcome = self._get(RENDEZVOUS, timeout)
            if outcome != "ok":
                raise NodeError(outcome)
            return
        deadline = time.monotonic() + timeout
        missing = list(range(1, self.nnodes))
        while missing and time.monotonic() < deadline and not interrupted():
            missing = [r for r in missing if not self.store.check([f"launch/node{r}"])]
            time.sleep(0.2)
        if missing:
            reason = (f"node 0 was interrupted while waiting for node(s) {missing}" if interrupted() else
                      f"node(s) {missing} did not join within server.ready_timeout={timeout:g}s")
            self.store.set(RENDEZVOUS, reason)
            raise NodeError(reason)
        self.store.set(RENDEZVOUS, "ok")
        now = time.monotonic()
        self._seen = {r: (0, now) for r in range(1, self.nnodes)}
        log.info("all nodes joined", nnodes=self.nnodes)

    def _get(self, key: str, timeout: float) -> str:
        try:
            self.store.wait([key], timedelta(seconds=timeout))
            return self.store.get(key).decode()
        except (RuntimeError, OSError) as e:
            return f"node 0 did not answer within {timeout:g}s: {e}"

    def poll(self) -> list[str]:
        """Called from the launcher's loop. Node 0: the nodes found dead. Other nodes: beat, and a reason
        to stop (node 0 stopped or unreachable) as a one-item list."""
        now = time.monotonic()
        try:
            if self.rank != 0:
                if now - self._last_beat >= self.cfg.server.node_timeout / 4:
                    self.store.add(f"launch/beat{self.rank}", 1)
                    self._last_beat = now
                return [self.store.get(STOP).decode()] if self.store.check([STOP]) else []
            dead = []
            for r, (count, since) in self._seen.items():
                if self.store.check([f"launch/failed{r}"]):
                    dead.append(f"node {r} ({self.store.get(f'launch/failed{r}').decode()})")
                    continue
                latest = self.store.add(f"launch/beat{r}", 0)
                if latest != count:
                    self._seen[r] = (latest, now)
                elif now - since > self.cfg.server.node_timeout:
                    dead.append(f"node {r} (no heartbeat for {now - since:.1f}s)")
            return dead
        except (RuntimeError, OSError) as e:
            return [f"node 0 unreachable: {e}"]

    def report(self, reason: str) -> None:
        """Node 0: tell the other nodes to stop; other nodes: tell node 0 this node failed."""
        try:
            self.store.set(STOP if self.rank == 0 else f"launch/failed{self.rank}", reason)
        except (RuntimeError, OSError):
            pass  # node 0 is gone already
