"""Each thread that computes owns its intra-op thread count (orca_mq/runtime/threads.py), and a worker's
stage executor builds its runner on the thread that runs it."""
from __future__ import annotations

import threading

import structlog
import torch

from orca_mq.config import load_config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.runtime.threads import use_threads
from kernels import cpu_kernels
from orca_mq.protocol.iteration import IterationPlan, SeqWork
from workers.data_plane import DataPlane
from workers.stage_executor import StageExecutor


def test_a_later_set_num_threads_elsewhere_does_not_reset_a_thread():
    """torch's lazy per-thread init would otherwise reset the first thread to the count the second set."""
    first_set, second_set, seen = threading.Event(), threading.Event(), []

    def first() -> None:
        use_threads(2)
        first_set.set()
        second_set.wait(30)
        torch.ones(1 << 16).sum()   # a parallel op: torch's lazy init would run here
        seen.append(torch.get_num_threads())

    def second() -> None:
        first_set.wait(30)
        use_threads(1)
        second_set.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == [2]


def test_the_decode_kernel_keeps_its_thread_count_after_another_thread_set_one():
    """A C++ extension has its own copy of torch's lazy per-thread init: with at::parallel_for, the
    kernel's first call reset the calling thread to the 1 another thread set last (issue 21)."""
    ext = cpu_kernels.load()
    assert ext is not None, "the CPU kernels must build on this machine (gcc is required)"
    kernel = ext.paged_decode_attention
    first_set, second_set, seen = threading.Event(), threading.Event(), []

    def first() -> None:
        use_threads(2)
        first_set.set()
        second_set.wait(30)
        cache = torch.randn(8, 4, 1, 16)
        kernel(torch.randn(4, 2, 16), cache, cache, torch.arange(8, dtype=torch.int32).view(4, 2),
               torch.full((4,), 8, dtype=torch.int32), 0.25)
        seen.append(torch.get_num_threads())

    def second() -> None:
        first_set.wait(30)
        use_threads(1)
        second_set.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == [2]


def test_a_worker_with_a_copy_thread_computes_on_all_its_threads(tiny_llama_dir):
    """A FastServe worker's KV copy thread sets 1 thread for itself; the compute thread keeps its
    threads_per_worker through its iterations (the decode kernel included)."""
    cfg = load_config(overrides={"model.path": str(tiny_llama_dir), "engine.n_slots": 64, "engine.host_slots": 64,
                                 "engine.threads_per_worker": 2, "engine.attention_backend": "cpu"})
    seen, done = [], threading.Event()

    def build() -> ModelRunner:   # as workers/main.py builds a FastServe stage
        runner = ModelRunner(cfg)
        runner.start_swap_thread()
        use_threads(cfg.engine.threads_per_worker)
        return runner

    def on_result(*_: object) -> None:
        seen.append(torch.get_num_threads())   # on the compute thread, after a decode iteration
        done.set()

    executor = StageExecutor(build, DataPlane(0, 1, torch.device("cpu"), None), torch.device("cpu"), on_ready=lambda r: None,
                             on_result=on_result, on_error=lambda e: done.set(), log=structlog.get_logger())
    executor.start()
    executor.submit(IterationPlan(1, [SeqWork("a", [5], 3, [0]), SeqWork("b", [6], 7, [1])]), 0.0)
    assert done.wait(60)
    executor.stop()
    assert seen == [2]


def test_the_stage_executor_builds_its_runner_on_its_compute_thread(tiny_llama_dir):
    cfg = load_config(overrides={"model.path": str(tiny_llama_dir), "engine.n_slots": 64, "engine.threads_per_worker": 2})
    built, ready = [], threading.Event()

    def build() -> ModelRunner:
        built.append(threading.current_thread().name)
        return ModelRunner(cfg)

    def on_ready(runner: ModelRunner) -> None:
        built.append(torch.get_num_threads())   # on the compute thread, after the build
        ready.set()

    executor = StageExecutor(build, DataPlane(0, 1, torch.device("cpu"), None), torch.device("cpu"), on_ready=on_ready,
                             on_result=lambda *a: None, on_error=lambda e: ready.set(), log=structlog.get_logger())
    executor.start()
    assert ready.wait(60)
    executor.stop()
    assert built == ["compute-0", 2] and executor.runner is not None
