"""Which node each worker process runs on. Pure arithmetic over the layout (pipeline stages x
tensor-parallel ranks over nodes), without torch: the launchers decide with it before any worker
starts, and a worker finds its GPU with it (device.py)."""
from __future__ import annotations


def placement(n_stages: int, tp_size: int, nnodes: int) -> list[int]:
    """Node of each worker, by global rank (stage * tp_size + tp rank). Stages go over the nodes in
    order, whole stages per node when there are at least as many stages as nodes; otherwise the
    ranks are spread evenly in order and a stage's TP group spans nodes."""
    world = n_stages * tp_size
    if world < nnodes:
        raise ValueError(f"{world} worker processes (n_workers x tp_size) cannot fill {nnodes} nodes")
    if n_stages >= nnodes:
        return [node for node, n in enumerate(_parts(n_stages, nnodes)) for _ in range(n * tp_size)]
    return [node for node, n in enumerate(_parts(world, nnodes)) for _ in range(n)]


def _parts(n: int, k: int) -> list[int]:
    base, extra = divmod(n, k)
    return [base + (i < extra) for i in range(k)]
