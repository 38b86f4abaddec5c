"""A worker's control sockets: where it pulls control frames and whom it forwards them to.

The scheduler pushes every frame to stage 0's TP rank 0. A stage's rank 0 forwards it, before
decoding it, to its stage's other TP ranks (they need it for this iteration's all-reduces) and to
the next stage's rank 0; so every rank of every stage applies every plan. On one node the sockets
are ipc in the launcher's run dir; when the upstream worker sits on another node, this worker binds
TCP on its interface towards node 0 and publishes the address in the rendezvous store, where the
upstream worker reads it. The last stage's rank 0 sends its results straight to the scheduler's
results socket when both are on node 0 (`results_address`), elsewhere through the broker.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
import zmq
import zmq.asyncio

from orca_mq.config import Config
from orca_mq.runtime.placement import placement
from orca_mq.server.nodes import local_ip
from orca_mq.server.zmq_queue import control_address, results_address

Peer = tuple[int, int]   # (stage, tp rank)


def upstream(peer: Peer) -> Peer | None:
    """Who forwards this worker its frames; None: the scheduler, on node 0."""
    stage, rank = peer
    if rank:
        return stage, 0
    return (stage - 1, 0) if stage else None


def downstream(peer: Peer, n_stages: int, tp_size: int) -> list[Peer]:
    stage, rank = peer
    if rank:
        return []
    return [(stage, r) for r in range(1, tp_size)] + ([(stage + 1, 0)] if stage + 1 < n_stages else [])


class ControlChain:
    def __init__(self, ctx: zmq.asyncio.Context, cfg: Config, run_dir: str, me: Peer,
                 store: dist.Store | None) -> None:
        tp = cfg.engine.tp_size
        nodes = placement(cfg.engine.n_workers, tp, cfg.server.nnodes)

        def node(p: Peer | None) -> int:
            return 0 if p is None else nodes[p[0] * tp + p[1]]

        def key(p: Peer) -> str:
            return f"ctl/{p[0]}/{p[1]}"

        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        if node(upstream(me)) == node(me):
            self.pull.bind(control_address(run_dir, *me))
        else:
            assert store is not None, "workers on many nodes always have the rendezvous store"
            ip = local_ip(cfg)
            port = self.pull.bind_to_random_port(f"tcp://{ip}")
            store.set(key(me), f"tcp://{ip}:{port}")
        last = me == (cfg.engine.n_workers - 1, 0)
        self.results_address = results_address(run_dir) if last and node(me) == node(None) else None
        self.pushes: list[zmq.asyncio.Socket] = []
        for peer in downstream(me, cfg.engine.n_workers, tp):
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 0)
            if node(peer) == node(me):
                push.connect(control_address(run_dir, *peer))
            else:
                assert store is not None
                push.connect(store.get(key(peer)).decode())  # waits until the peer has bound
            self.pushes.append(push)

    async def recv(self) -> bytes:
        frame: Any = await self.pull.recv(copy=True)
        return bytes(frame)

    async def forward(self, frame: bytes) -> None:
        for push in self.pushes:
            await push.send(frame, copy=False)

    def close(self) -> None:
        for sock in (self.pull, *self.pushes):
            sock.close(linger=0)
