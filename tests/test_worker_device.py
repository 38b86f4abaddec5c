"""Every worker computes on the GPU of its rank, on every thread that touches CUDA (orca_mq/runtime/device.py).

CUDA's current device is per thread. Checked on the CPU with a stand-in for torch.cuda that records
which device each thread set: the worker's device comes from its place in the grid, and the compute
thread (which builds the model, the KV pool and the buffers) and the KV swap thread set it themselves.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import structlog
import torch

from orca_mq.config import load_config
from orca_mq.runtime import device
from orca_mq.runtime.device import resolve_device, worker_device
from workers.data_plane import DataPlane
from orca_mq.kv.swapper import KVSwapper
from workers.stage_executor import StageExecutor


@pytest.fixture
def bound(monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.device]:
    """A node with 4 GPUs; thread name -> the device that thread made current."""
    seen: dict[str, torch.device] = {}
    monkeypatch.setattr(device, "GPU_DRIVER_PATHS", ("/",))   # a driver's path that exists
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.__setitem__(threading.current_thread().name, torch.device(d)))
    return seen


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


def test_a_worker_device_comes_from_its_rank_on_its_node(bound: dict[str, torch.device]) -> None:
    one = load_config(overrides={"engine.device": "cuda", "engine.n_workers": 2, "engine.tp_size": 2})
    assert [worker_device(one, s, r) for s in range(2) for r in range(2)] == [cuda(0), cuda(1), cuda(2), cuda(3)]
    two = load_config(overrides={"engine.device": "cuda", "engine.n_workers": 2, "engine.tp_size": 2, "server.nnodes": 2})
    assert [worker_device(two, s, r) for s in range(2) for r in range(2)] == [cuda(0), cuda(1), cuda(0), cuda(1)]
    assert resolve_device("auto").index == 0 and resolve_device("cuda", 5) == cuda(1)   # never a bare "cuda"
    assert worker_device(load_config(overrides={"engine.device": "cpu"}), 0, 0) == torch.device("cpu")


def test_the_compute_and_swap_threads_use_the_worker_device(bound: dict[str, torch.device]) -> None:
    cfg = load_config(overrides={"engine.device": "cuda", "engine.n_workers": 2, "engine.tp_size": 2})
    device = worker_device(cfg, 1, 1)
    assert device == cuda(3)
    built, ready = {}, threading.Event()

    def build() -> SimpleNamespace:   # what ModelRunner's allocations would see as the current device
        built["compute"] = bound.get(threading.current_thread().name)
        return SimpleNamespace()

    executor = StageExecutor(build, DataPlane(0, 1, torch.device("cpu"), None), device, on_ready=lambda r: ready.set(),
                             on_result=lambda *a: None, on_error=lambda e: ready.set(), log=structlog.get_logger())
    executor.start()
    assert ready.wait(30)
    executor.stop()
    assert built["compute"] == device

    # a pool on the worker's device as far as the swapper asks (its host pool is built on the CPU)
    kv = SimpleNamespace(k=SimpleNamespace(device=device, is_cuda=False, shape=(1, 1, 1, 1), dtype=torch.float32))
    swapper = KVSwapper(kv, 4, depth=1)   # type: ignore[arg-type]
    swapper.close()
    assert bound["kv-swap"] == device


@pytest.mark.parametrize(("sets", "gpus", "refused"), [
    ({"engine.device": "cuda", "engine.n_workers": 2}, 1, True),                      # the GPU run's NCCL death
    ({"engine.device": "auto", "engine.n_workers": 2}, 1, True),
    ({"engine.device": "cuda", "engine.n_workers": 2, "engine.tp_size": 2}, 3, True),
    ({"engine.device": "cuda", "engine.n_workers": 1}, 0, True),
    ({"engine.device": "cuda", "engine.n_workers": 2}, 2, False),
    ({"engine.device": "cuda", "engine.n_workers": 4, "server.nnodes": 2}, 2, False),  # 2 per node
    ({"engine.device": "auto", "engine.n_workers": 2}, 0, False),                     # auto without CUDA: the CPU
    ({"engine.device": "cpu", "engine.n_workers": 4}, 1, False),
])
def test_more_workers_than_gpus_on_a_node_is_refused_at_start(sets: dict, gpus: int, refused: bool) -> None:
    from orca_mq.server.nodes import check_gpus

    cfg = load_config(overrides=sets)
    if refused:
        with pytest.raises(ValueError, match=f"{gpus} CUDA device"):
            check_gpus(cfg, lambda: gpus)
    else:
        check_gpus(cfg, lambda: gpus)


def test_the_launcher_refuses_in_one_line_before_starting_anything(tmp_path) -> None:
    """This machine has no GPU: two CUDA workers are refused by the launcher's start-up check, exit 1."""
    import subprocess
    import sys
    import time

    from orca_mq.server.process import ROOT, free_port

    t = time.monotonic()
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), "--port", str(free_port()),
                          "--set", "engine.device=cuda", "--set", "engine.n_workers=2", "--set", "server.http_address=",
                          "--set", f"log.dir={tmp_path}"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "orca-mq: workers: 2 workers on this node" in out.stderr and "0 CUDA device(s)" in out.stderr
    assert out.stdout == "" and time.monotonic() - t < 30   # refused at once: no ready line, no model loaded


def test_auto_is_the_cpu_without_asking_torch_where_no_gpu_driver_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher decides engine.device = auto for its children; on a host without a GPU driver it does
    so without importing torch (2 s of every start); with one, torch decides."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "GPU_DRIVER_PATHS", ("/nonexistent/nvidia",))
    assert not device.uses_cuda("auto") and device.uses_cuda("cuda")
    monkeypatch.setattr(device, "GPU_DRIVER_PATHS", ("/",))
    assert device.uses_cuda("auto")
