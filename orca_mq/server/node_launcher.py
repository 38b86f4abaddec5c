"""The launcher of a node other than 0: it runs only this node's workers (orca_mq/server/nodes.py).

It meets node 0 at the rendezvous, spawns its share of the workers, and then runs until node 0
stops (exit 0), node 0 becomes unreachable (exit 1), or one of its workers dies: that is reported
to node 0, which fails the in-flight requests, and this launcher exits 1.
"""
from __future__ import annotations

import time

from orca_mq.server.launcher import POLL, Launcher
from orca_mq.server.nodes import STOPPED, NodeGroup


class NodeLauncher(Launcher):
    def _start(self, group: str) -> None:
        self.child_cfg = self.cfg
        self.nodes = NodeGroup.open(self.cfg)
        self.nodes.join(self.log, lambda: self.signals > 0)
        self._spawn_workers()

    def _ready_line(self) -> str:
        return f"orca-mq node {self.node_rank} joined {self.cfg.server.master_addr}:{self.cfg.server.worker_base_port}"

    def _supervise(self) -> int:
        assert self.nodes is not None
        while not self.signals:
            if dead := self._dead():
                what = ", ".join(f"{c.role} (exit {c.proc.returncode})" for c in dead)
                self.log.error("a worker died", processes=what)
                self.nodes.report(f"{what} died")
                return 1
            if stop := self._dead_nodes():
                self.log.info("stopping", reason=stop[0])
                return 0 if stop[0] == STOPPED else 1
            time.sleep(POLL)
        self.nodes.report("stopped by a signal")
        return 0
