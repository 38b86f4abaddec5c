"""Moves an iteration's laid-out inputs to the device: one write on the host, one copy.

On CUDA the inputs are written into a pinned host buffer and copied to the device buffer with one
non-blocking copy on the compute stream, so nothing waits for it but the kernels that read it.
Pinned buffers come from a ring of two: while the device may still be copying one iteration's
inputs (async scheduling keeps one iteration ahead), the host writes the next into the other, and
before reusing a slot it waits for that slot's copy to have happened (normally long done). On the
CPU the host writes straight into the buffer the model reads.
"""
from __future__ import annotations

import torch

from orca_mq.engine.step_inputs import Bucket, HostStep, Layout, write

Tensor = torch.Tensor
RING = 2


class Stager:
    def __init__(self, device: torch.device, scratch_block: int) -> None:
        self.device = device
        self.scratch_block = scratch_block
        self.cuda = device.type == "cuda"
        self._pinned: list[Tensor | None] = [None] * RING
        self._copied: list[torch.cuda.Event | None] = [None] * RING
        self._slot = 0
        self._eager: Tensor | None = None

    def stage(self, step: HostStep, lay: Layout, dst: Tensor | None = None, bucket: Bucket | None = None) -> Tensor:
        """`step` laid out by `lay` (padded to `bucket`) in `dst` (a device buffer of at least
        lay.nbytes; None: the eager buffer, grown as needed), which is returned."""
        n = lay.nbytes
        if dst is None:
            dst = self._eager_buffer(n)
        if not self.cuda:
            write(step, lay, dst[:n].numpy(), self.scratch_block, bucket)
            return dst
        host = self._host(n)
        write(step, lay, host[:n].numpy(), self.scratch_block, bucket)
        if bucket is not None:   # what the bucket's views read: up to the end of its rows' block tables
            n = lay.through("block_tables", bucket.rows)
        dst[:n].copy_(host[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._slot] = event
        return dst

    def _eager_buffer(self, n: int) -> Tensor:
        if self._eager is None or self._eager.numel() < n:
            # the old buffer may still be read by kernels in flight: the caching allocator reuses its
            # memory only for work queued after them on this stream
            self._eager = torch.empty(max(n, 4096) * 2, dtype=torch.uint8, device=self.device)
        return self._eager

    def _host(self, n: int) -> Tensor:
        self._slot = (self._slot + 1) % RING
        if (event := self._copied[self._slot]) is not None:
            event.synchronize()
        buf = self._pinned[self._slot]
        if buf is None or buf.numel() < n:
            buf = self._pinned[self._slot] = torch.empty(max(n, 4096) * 2, dtype=torch.uint8, pin_memory=True)
        return buf

