"""Embeddings on the last stage, only for the rows that pool (orca_mq/protocol/pooling.py).

A pooling row asks for the sum of the final norm's output over its last `pool_counts` tokens. The
model computes the final norm at those token rows in a call of its own (`AttentionMetadata.pool_rows`,
after the LM head's rows, eagerly: CUDA graphs and the sampling rows keep their shape); here they are
summed per row in float32 on the device and copied back without waiting, like log probabilities.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from orca_mq.protocol.iteration import PlanArrays

Tensor = torch.Tensor


@dataclass(slots=True)
class PoolPositions:
    """The token rows an iteration pools over, and which pooling row each one adds to."""

    rows: list[int]            # plan rows that pool, ascending
    token_rows: np.ndarray     # int64 [N] the iteration's token rows whose final-norm output is pooled
    index: np.ndarray          # int64 [N] the pooling row (0 .. len(rows) - 1) each adds to


def pool_positions(a: PlanArrays) -> PoolPositions | None:
    """A pooling row's tokens are its last `count` of the iteration's flattened tokens."""
    if a.pool_rows is None or a.pool_counts is None:
        return None
    counts = a.pool_counts.astype(np.int64)
    ends = np.cumsum(a.q_lens.astype(np.int64))[a.pool_rows]
    index = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return PoolPositions(a.pool_rows.tolist(), np.repeat(ends - counts, counts) + within, index)


@dataclass(slots=True)
class Pooled:
    """An iteration's pooled sums, issued on the device (a host copy once `copy` ran)."""

    rows: list[int]
    sums: Tensor               # [len(rows), hidden] float32

    def copy(self) -> "Pooled":
        """The same on the host, copied without waiting (pinned memory on CUDA: the caller's event covers it)."""
        if not self.sums.is_cuda:
            return self
        host = torch.empty(self.sums.shape, dtype=self.sums.dtype, pin_memory=True)
        return Pooled(self.rows, host.copy_(self.sums, non_blocking=True))

    def as_bytes(self) -> bytes:
        """Little-endian float32, a row after the other (read after the copy landed)."""
        return self.sums.numpy().astype("<f4", copy=False).tobytes()


def pool(normed: Tensor, positions: PoolPositions) -> Pooled:
    """normed [N, hidden]: the final norm's output at `positions.token_rows`, in float32."""
    index = torch.from_numpy(positions.index).to(normed.device)
    sums = torch.zeros(len(positions.rows), normed.shape[1], dtype=torch.float32, device=normed.device)
    return Pooled(positions.rows, sums.index_add_(0, index, normed))
