"""Iteration plans built by hand for engine measurements and exactness checks (no scheduler), and
the block-table arithmetic the benchmarks share (`blocks_for`, `kv_room`, `block_tables`)."""
from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from orca_mq.config import load_config
from orca_mq.kv.block_manager import BlockManager
from orca_mq.protocol.iteration import IterationPlan, SeqWork

if TYPE_CHECKING:
    import torch

    from orca_mq.engine.model_runner import ModelRunner


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold n_tokens tokens (the KV pool's PoolSize.blocks_for, for a bare block size)."""
    return -(-n_tokens // block_size)


def kv_room(requests: int, max_len: int, block_size: int) -> int:
    """KV slots (engine.n_slots) in which `requests` requests of up to max_len tokens all reserve their
    whole blocks at once, beside the fair shares' headroom (server.client_headroom of the pool, which one
    client may not reserve)."""
    blocks = requests * blocks_for(max_len, block_size)
    return math.ceil(blocks / (1 - load_config().server.client_headroom)) * block_size


def block_tables(lengths: Iterable[int], block_size: int) -> list[list[int]]:
    """A table per request of lengths[i] tokens, each on consecutive blocks of its own: request 0 from
    block 0, request 1 from the block after request 0's last, and so on."""
    tables, next_block = [], 0
    for n_tokens in lengths:
        n = blocks_for(n_tokens, block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return tables


def plan_for(reqs: list[tuple[int, int]], block_size: int) -> IterationPlan:
    """One iteration of [(new tokens, cached tokens before)] per request, each on blocks of its own.
    Its cached context is left as the pool's zeros: what attention reads costs the same whatever the
    values, and computing 64 x 255 tokens of real context took minutes on a loaded machine."""
    tables = block_tables((ctx + q for q, ctx in reqs), block_size)
    return IterationPlan(1, [SeqWork(f"r{r}", [7 + (r % 50)] * q, ctx, table)
                             for r, ((q, ctx), table) in enumerate(zip(reqs, tables))])


def mixed_iteration_logits(runner: "ModelRunner", prefills: list[list[int]], decodes: list[list[int]],
                           rng: random.Random) -> "torch.Tensor":
    """Run every decode request's prefix first (filling its KV), then ONE iteration mixing the full
    prefills with each decode request's last token at its own position. Returns that iteration's
    logits, prefills first, in the order given (no prefills: a decode-only iteration)."""
    bm = BlockManager(runner.pool)
    rng.shuffle(bm.device.free)  # block tables scattered over the pool
    warm = []
    for i, seq in enumerate(decodes):
        table = bm.ensure(f"d{i}", len(seq))
        warm.append(SeqWork(f"d{i}", seq[:-1], 0, list(table)))
    runner.forward(IterationPlan(0, warm))
    mixed = [SeqWork(f"d{i}", [seq[-1]], len(seq) - 1, list(bm.table(f"d{i}"))) for i, seq in enumerate(decodes)]
    mixed += [SeqWork(f"p{i}", seq, 0, list(bm.ensure(f"p{i}", len(seq)))) for i, seq in enumerate(prefills)]
    rng.shuffle(mixed)
    logits = runner.forward(IterationPlan(1, mixed))
    order = {s.request_id: b for b, s in enumerate(mixed)}
    names = [f"p{i}" for i in range(len(prefills))] + [f"d{i}" for i in range(len(decodes))]
    return logits[[order[n] for n in names]]
