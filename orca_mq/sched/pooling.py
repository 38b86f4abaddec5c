"""Embedding requests in the scheduler: prefill-only rows inside iteration-level batching.

An embedding request (Request.pooling set) is planned as any prompt, chunk by chunk under the token
budget, beside generating requests; its rows sample nothing. Each of its chunks asks the last stage
for the pooled sum of its final-norm rows (every token for "mean", the prompt's last for "last": only
its last chunk pools then), and the request adds them up (`PooledRows.add`); the prompt's last chunk
ends it, its vector made (orca_mq.protocol.pooling.finish) and its KV released at once: it keeps no
KV and never enters the increment phase.

An iteration's pooled vectors travel in one result frame and one client frame each: at most
MAX_POOLED_BYTES of them (`max_pooled_rows`), the rest of the embedding rows wait an iteration.
"""
from __future__ import annotations

import numpy as np

from orca_mq.protocol.iteration import F32, IterationResult, SeqWork
from orca_mq.protocol.pooling import finish
from orca_mq.sched.request import Phase, Request

MAX_POOLED_BYTES = 16 << 20   # pooled float32 vectors per iteration (a result's, a client's frame): well below a frame's 64 MiB


def max_pooled_rows(hidden_size: int) -> int:
    return max(1, MAX_POOLED_BYTES // (F32.itemsize * hidden_size))


def pools(req: Request) -> bool:
    """Its next row may pool: an embedding request still feeding its prompt (the request-level
    baseline reruns a finished one's last position, which pools nothing)."""
    return req.pooling is not None and req.phase is Phase.INITIATION


def ask_pooling(seqs: list[SeqWork], batch: list[Request]) -> None:
    """The embedding rows' pooling asks (SeqWork.pool), counted on the request as they are planned."""
    for s, req in zip(seqs, batch):
        if not pools(req):
            continue
        assert req.pooling is not None
        if req.pooling.mean:
            s.pool = len(s.token_ids)
        elif s.seq_len == len(req.prompt_token_ids):
            s.pool = 1
        req.pooled_count += s.pool


class PooledRows:
    """One result's pooled sums, by plan row."""

    def __init__(self, result: IterationResult) -> None:
        n = len(result.pool_rows)
        sums = np.frombuffer(result.pooled, F32)
        if n and len(sums) % n:
            raise ValueError(f"result of iteration {result.iteration}: {len(sums)} pooled floats over {n} rows")
        self.sums = sums.reshape(n, -1) if n else sums
        self.at = {r: i for i, r in enumerate(result.pool_rows)}

    def add(self, req: Request, row: int) -> str | None:
        """Its row's sum added to what it pooled so far; when the row ended its prompt, how it ends:
        "stop" with its vector made (req.embedding), or "error" if the last stage returned no sum."""
        if (i := self.at.get(row)) is not None:
            v = self.sums[i].astype(np.float64)
            req.pooled = v if req.pooled is None else req.pooled + v
        if req.prompt_pending:
            return None
        assert req.pooling is not None
        if req.pooled is None:
            return "error"
        req.embedding = finish(req.pooled, req.pooled_count, req.pooling.normalize)
        return "stop"
