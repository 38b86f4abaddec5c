"""A stage's KV pool sized from its device's memory at start (the terms: orca_mq/kv/sizing.py).

The runner has loaded its weights and built its model, with no pool yet. On a pool just big enough
for it, one eager iteration at the token budget runs (the scheduler's largest: its prompt rows
sample, so the LM head and the sampler's buffers are in the peak), then the CUDA graphs are captured
and measured; both are dropped, and what is in use then (weights, buffers, the context, NCCL's
buffers after the first collective) is read. The figure every stage takes is the smallest
(`agree`: an all-reduce over the workers); a pool that cannot hold one max_model_len request is
refused. The graphs are captured again on the real pool by the runner (the same buckets: the same memory).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from orca_mq.kv.pool import PoolSize
from orca_mq.kv.sizing import DeviceMemory, KVSizing, check_fits
from orca_mq.protocol.iteration import IterationPlan, SeqWork

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)
Agree = Callable[[int], int]   # this stage's block count -> the one every stage takes (the smallest)


def profile_rows(budget: int, max_bs: int, max_len: int) -> list[int]:
    """Prompt lengths of the profiled iteration: the most tokens an iteration carries (the token
    budget, or max_bs when that is more: each decode row takes its token past a smaller budget; 0,
    whole prompts: the context) over max_bs rows (fewer when there are fewer tokens), none longer
    than max_len - 1."""
    tokens = max(budget, max_bs) if budget else max_len - 1
    rows = max(min(max_bs, tokens), -(-tokens // (max_len - 1)))
    base, extra = divmod(tokens, rows)
    return [base + (i < extra) for i in range(rows)]


def profile_plan(lengths: list[int], block_size: int) -> IterationPlan:
    """One prompt row per length, each on blocks of its own, sampled as the heaviest request samples
    (temperature, top-k and top-p)."""
    seqs, first = [], 0
    for i, n in enumerate(lengths):
        blocks = -(-n // block_size)
        seqs.append(SeqWork(f"kv-profile-{i}", [1] * n, 0, list(range(first, first + blocks)),
                            temperature=1.0, top_k=50, top_p=0.9, seed=i))
        first += blocks
    return IterationPlan(1, seqs)


def size_pool(runner: "ModelRunner", cfg: "Config", layers: range, memory: DeviceMemory, agree: Agree) -> KVSizing:
    """Measure, agree and allocate the stage's pool (runner.use_pool); the terms."""
    gc.collect()   # a runner dropped before this one may hold its pool until its reference cycles are collected
    bs = cfg.engine.block_size
    plan = profile_plan(profile_rows(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_bs, runner.max_len), bs)
    runner.use_pool(PoolSize(bs, sum(len(s.block_table) for s in plan.seqs), 0))
    memory.release()
    start = memory.allocated()
    memory.reset_peak()
    hidden = None if runner.first else torch.zeros(plan.num_tokens, runner.hidden_size, dtype=runner.dtype,
                                                   device=runner.device)
    runner.execute(plan, hidden)
    memory.release()
    activations = max(0, memory.peak() - start)
    before = memory.reserved()
    graphs = runner.build_graphs(cfg, layers)
    memory.release()
    graph_bytes = max(0, memory.reserved() - before) if graphs is not None else 0
    del graphs
    block_bytes = runner.kv.block_bytes()
    runner.use_pool(None)
    memory.release()
    free, total = memory.info()
    held = memory.reserved()
    sizing = KVSizing(total, cfg.engine.gpu_memory_utilization, held, total - free - held, activations, graph_bytes,
                      block_bytes, bs)
    agreed = agree(sizing.blocks)
    sizing = dataclasses.replace(sizing, agreed=agreed)
    log.info("KV pool from the device's memory: %s", sizing.describe())
    check_fits(sizing, runner.max_len)
    runner.use_pool(PoolSize(bs, agreed, cfg.engine.host_slots // bs))
    return sizing
