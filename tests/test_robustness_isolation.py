"""One request's failure on a worker ends that request, not the worker nor its batch-mates.

The real compute thread (StageExecutor) runs a real ModelRunner on the tiny Llama for plans made
by the real scheduler; the faults are packed plans carrying what validation would have refused (a temperature
torch cannot take) or a block table that cannot hold the sequence (the model raises).
"""
from __future__ import annotations

import dataclasses
import queue
import threading

import numpy as np

import structlog

from orca_mq.config import load_config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.models.registry import read_model_info
from orca_mq.kv.cache import HostKV
from orca_mq.protocol.iteration import IterationPlan, IterationResult, PackedPlan, SeqWork, pack
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched import make_scheduler
from orca_mq.sched.request import Request
from workers.data_plane import DataPlane
from workers.stage_executor import StageExecutor


def test_failed_work_ends_only_its_requests_and_frees_their_kv(tiny_llama_dir):
    cfg = load_config(overrides={"model.path": str(tiny_llama_dir), "engine.block_size": 8, "engine.n_slots": 256,
                                 "engine.threads_per_worker": 1, "scheduler.max_bs": 4})
    info = read_model_info(cfg.model.path, cfg.model.cache_dir)
    runner = ModelRunner(cfg, info=info)
    sched = make_scheduler(cfg, info)
    results: queue.Queue[IterationResult] = queue.Queue()
    errors: list[BaseException] = []
    executor = StageExecutor(lambda: runner, DataPlane(0, 1, runner.device, None), runner.device, on_ready=lambda r: None,
                             on_result=lambda r, t0, t1: results.put(r), on_error=errors.append, log=structlog.get_logger())
    executor.start()

    def run(packed: PackedPlan) -> dict[str, str | None]:
        executor.submit(packed, 0.0)   # in columns, as a control frame carries it
        return {e.request_id: e.finish_reason for e in sched.process_result(results.get(timeout=60), 0.0)}

    greedy, sampled = SamplingParams(max_tokens=3, temperature=0.0), SamplingParams(max_tokens=3, temperature=1.0)
    for rid, params in (("a", greedy), ("b", sampled), ("c", greedy)):
        sched.add(Request(rid, [1, 2, 3, 4, 5], params))
    plan = sched.schedule(0.0)
    assert plan is not None and [s.request_id for s in plan.seqs] == ["a", "b", "c"]
    packed = pack(plan)
    temperature = np.frombuffer(packed.temperature, np.float32).copy()
    temperature[1] = np.nan   # sampling raises for b alone
    assert run(dataclasses.replace(packed, temperature=temperature.tobytes())) == {"a": None, "b": "error", "c": None}
    assert "b" not in sched.pool and "b" not in sched.block_manager.device.tables

    plan = sched.schedule(0.0)   # all decodes: planned in columns (orca_mq/sched/columns.py)
    assert plan is not None
    packed = pack(plan)
    lens, tables = np.frombuffer(packed.table_lens, np.int32).copy(), np.frombuffer(packed.tables, np.int32)
    tables, lens[0] = tables[lens[0]:], 0   # row 0 without a block table: the model raises, the whole iteration
    assert run(dataclasses.replace(packed, table_lens=lens.tobytes(), tables=tables.tobytes())) == {"a": "error", "c": "error"}
    assert sched.block_manager.num_used_slots == 0 and not sched.has_work()

    sched.add(Request("d", [7, 8, 9], greedy))
    assert run(pack(sched.schedule(0.0))) == {"d": None}  # the same worker serves the next request
    executor.stop()
    assert errors == [] and executor.stats(reset=False)["failed_iterations"] == 1


def test_a_failed_kv_copy_ends_the_worker(tiny_llama_dir, monkeypatch):
    """A copy that fails leaves the stage's KV pools in an unknown state: no later iteration can
    compute, so the compute thread reports a worker failure (the worker exits and the launcher
    restarts it) instead of failing every later iteration while the process lives on."""
    cfg = load_config(overrides={"model.path": str(tiny_llama_dir), "engine.block_size": 8, "engine.n_slots": 64,
                                 "engine.host_slots": 64, "engine.threads_per_worker": 1})
    runner = ModelRunner(cfg)
    runner.start_swap_thread()

    def broken(*_: object) -> None:
        raise OSError("copy failed")

    monkeypatch.setattr(HostKV, "offload", broken)
    results: queue.Queue[IterationResult] = queue.Queue()
    failed = threading.Event()
    executor = StageExecutor(lambda: runner, DataPlane(0, 1, runner.device, None), runner.device, on_ready=lambda r: None,
                             on_result=lambda r, t0, t1: results.put(r), on_error=lambda e: failed.set(),
                             log=structlog.get_logger())
    executor.start()
    executor.submit(IterationPlan(1, [SeqWork("a", [1, 2, 3], 0, [0])], swap_out=[(1, 0)]), 0.0)
    executor.submit(IterationPlan(2, [SeqWork("b", [4, 5], 0, [2])]), 0.0)
    assert failed.wait(30), f"the worker went on: {results.get(timeout=5)}"
    assert results.empty()
    runner.swapper.close()
