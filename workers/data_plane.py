"""Hidden states between pipeline stages over torch.distributed point-to-point.

Only the workers form the process group (rank = stage). gloo on CPU, nccl on CUDA. Sends are
asynchronous (isend) so a stage can start its next iteration while the previous hidden states
are still travelling; each tensor is kept alive until its send completes. The tag is the
iteration number, so a stage can never consume another iteration's hidden states.
"""
from __future__ import annotations

from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

MAX_PENDING_SENDS = 4
_TAG_MASK = (1 << 31) - 1


class DataPlane:
    def __init__(self, stage: int, n_stages: int, port: int, device: torch.device) -> None:
        self.stage = stage
        self.n_stages = n_stages
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()
        if n_stages > 1:
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=stage,
                world_size=n_stages,
                timeout=timedelta(minutes=10),
            )

    def recv(self, iteration: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src=self.stage - 1, tag=iteration & _TAG_MASK)
        return buf

    def send(self, iteration: int, hidden: torch.Tensor) -> None:
        hidden = hidden.contiguous()
        self._pending.append((dist.isend(hidden, dst=self.stage + 1, tag=iteration & _TAG_MASK), hidden))
        while self._pending and (len(self._pending) > MAX_PENDING_SENDS or self._pending[0][0].is_completed()):
            self._pending.popleft()[0].wait()
