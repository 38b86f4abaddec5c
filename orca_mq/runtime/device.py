"""Which device a process computes on, always with an explicit index on CUDA.

CUDA's current device belongs to a thread, not to a process: a worker that set it on its main
thread and built its model, KV pool and buffers on its compute thread with a bare
`torch.device("cuda")` put every worker of a node on GPU 0 (and NCCL between them then fails).
So every tensor gets a device with an index (`cuda:i`), and every thread that touches CUDA calls
`use_device` first (a worker's main thread, its compute thread and its KV swap thread).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from orca_mq.runtime.placement import placement

if TYPE_CHECKING:
    import torch

    from orca_mq.config import Config


def resolve_device(name: str, local_index: int = 0) -> torch.device:
    """`engine.device` (auto | cpu | cuda) -> a device; on CUDA the `local_index`-th GPU of this node
    (modulo the GPUs there are)."""
    import torch

    if name == "auto":
        name = "cuda" if uses_cuda(name) else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("engine.device = cuda but no CUDA device is available")
        return torch.device("cuda", local_index % torch.cuda.device_count())
    return torch.device(name)


# A GPU's kernel driver shows here (NVIDIA's; WSL2's GPU bridge; Jetson's; ROCm's for torch's HIP build):
# without one torch sees no CUDA device, so such a host is answered without importing torch (2 s of a
# launcher's start); `engine.device = cuda` never asks.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/nvhost-ctrl-gpu", "/dev/kfd")


def uses_cuda(name: str) -> bool:
    """Whether `engine.device` (auto | cpu | cuda) computes on CUDA here. torch is imported only to decide
    auto on a host with a GPU driver, which the launcher decides for its children: the processes that do
    not compute never import it."""
    if name != "auto":
        return name == "cuda"
    if not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
        return False
    import torch

    return torch.cuda.is_available()


def check_fp8(cfg: "Config") -> None:
    """Before any process starts: FP8 asked of an engine that runs on the CPU (on CUDA each worker checks
    its GPU: engine/fp8.py `require`)."""
    for what, asked in (("model.quantization = fp8", cfg.model.quantization == "fp8"),
                        ("engine.kv_cache_dtype = fp8", cfg.engine.kv_cache_dtype == "fp8")):
        if asked and not uses_cuda(cfg.engine.device):
            raise ValueError(f"{what} needs a GPU with FP8 (Hopper or Ada): the engine runs on the CPU here")


def worker_device(cfg: "Config", stage: int, tp_rank: int) -> torch.device:
    """A worker's device: one GPU per worker of its node, in placement order (stage-major ranks)."""
    nodes = placement(cfg.engine.n_workers, cfg.engine.tp_size, cfg.server.nnodes)
    rank = stage * cfg.engine.tp_size + tp_rank
    return resolve_device(cfg.engine.device, nodes[:rank].count(nodes[rank]))


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing to do on the CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
