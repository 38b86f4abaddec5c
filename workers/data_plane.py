"""Hidden states between pipeline stages, and the stages' tensor-parallel groups, over torch.distributed.

Only the workers form the process group: `n_stages * tp_size` ranks, stage-major (global rank =
stage * tp_size + tp rank). gloo on CPU, nccl on CUDA. The rendezvous is a TCP store hosted by
node 0's launcher (`orca_mq.server.nodes`), so workers on other hosts join the same way. Each
stage gets its own group for TP's all-reduces; hidden states travel point-to-point on the pipeline
edge from rank r of a stage to rank r of the next (every rank of a stage holds the whole [T, H]
after its all-reduce). Sends are asynchronous (isend) so a stage can start its next iteration while
the previous hidden states are still travelling; each tensor is kept alive until its send completes.
The tag is the iteration number, so a stage can never consume another iteration's hidden states.
"""
from __future__ import annotations

from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from orca_mq.engine.parallel import TPGroup

MAX_PENDING_SENDS = 4
_TAG_MASK = (1 << 31) - 1
STORE_PREFIX = "dist/"


class DataPlane:
    def __init__(self, stage: int, n_stages: int, device: torch.device, store: dist.Store | None,
                 tp_rank: int = 0, tp_size: int = 1, timeout: float = 600.0) -> None:
        self.stage, self.n_stages, self.tp_size = stage, n_stages, tp_size
        self.rank = stage * tp_size + tp_rank
        self.device = device
        self.tp = TPGroup(tp_rank, tp_size)
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()
        world = n_stages * tp_size
        if world == 1:
            return
        assert store is not None, "more than one worker needs the rendezvous store"
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.PrefixStore(STORE_PREFIX, store), rank=self.rank, world_size=world,
            timeout=timedelta(seconds=timeout), device_id=device if device.type == "cuda" else None,
        )
        if tp_size > 1:  # every rank creates every stage's group, in the same order
            groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(n_stages)]
            self.tp.group = groups[stage]

    def agree_min(self, n: int) -> int:
        """The smallest of every worker's `n` (the KV blocks each stage's memory leaves it): one
        all-reduce, which every worker makes once, at start."""
        if not dist.is_initialized():
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def recv(self, iteration: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src=self.rank - self.tp_size, tag=iteration & _TAG_MASK)
        return buf

    def send(self, iteration: int, hidden: torch.Tensor) -> None:
        hidden = hidden.contiguous()
        self._pending.append((dist.isend(hidden, dst=self.rank + self.tp_size, tag=iteration & _TAG_MASK), hidden))
        while self._pending and (len(self._pending) > MAX_PENDING_SENDS or self._pending[0][0].is_completed()):
            self._pending.popleft()[0].wait()
