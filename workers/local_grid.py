"""A stages x TP grid of worker processes on this machine, without the serving stack: every rank
joins the rendezvous, builds its ModelRunner and runs a job given a `step` that moves hidden states
along the pipeline. The exactness tests (tests/test_tensor_parallel.py) and tools/bench_tp.py use it.
"""
from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from orca_mq.config import Config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.protocol.iteration import IterationPlan
from workers.data_plane import DataPlane

Step = Callable[[IterationPlan], torch.Tensor]   # run one plan on this rank: hidden states, or logits on the last stage
Job = Callable[[Step, ModelRunner, Any], Any]     # module-level function: it is pickled into every rank


def _rank_main(rank: int, n_stages: int, tp: int, port: int, cfg_dict: dict[str, Any], job: Job, payload: Any,
               out: Any, timeout: float) -> None:
    stage, tp_rank = divmod(rank, tp)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    plane = DataPlane(stage, n_stages, torch.device("cpu"), store, tp_rank, tp, timeout=timeout)
    runner = ModelRunner(Config.from_dict(cfg_dict), stage, n_stages, tp=plane.tp)

    def step(plan: IterationPlan) -> torch.Tensor:
        hidden = plane.recv(plan.iteration, (plan.num_tokens, runner.hidden_size), runner.dtype, runner.device) \
            if stage > 0 else None
        result = runner.forward(plan, hidden)
        if not runner.last:
            plane.send(plan.iteration, result)
        return result

    result = job(step, runner, payload)
    if runner.last and tp_rank == 0:
        out.put(result)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_grid(n_stages: int, tp: int, cfg: Config, job: Job, payload: Any, timeout: float = 240.0) -> Any:
    """Host the rendezvous (as node 0's launcher does), start n_stages x tp ranks, return what the last
    stage's TP rank 0 returned from `job`."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, n_stages, tp, store.port, cfg.to_dict(), job, payload, out, timeout))
             for r in range(n_stages * tp)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=timeout)
        for p in procs:
            p.join(timeout=60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"grid ranks exited with {[p.exitcode for p in procs]}")
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
