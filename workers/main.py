"""Entry point of one worker process: `python -m workers.main --stage I --tp-rank R --run-dir D --config-json J`."""
from __future__ import annotations

import argparse

import torch
import uvloop

from orca_mq.config import Config
from orca_mq.logs import setup_logging
from orca_mq.server.process import child_config, exit_now, run_logged
from orca_mq.sched import policy_class
from orca_mq.runtime.device import use_device, worker_device
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.runtime.threads import use_threads
from orca_mq.server.nodes import connect_store, uses_store, worker_name
from workers.controller import Controller
from workers.data_plane import DataPlane


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="orca-mq worker (one tensor-parallel rank of one pipeline stage)")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--run-dir", required=True, help="directory of this node's control sockets")
    args = parser.parse_args(argv)
    cfg = child_config(args.config_json)
    name = worker_name(args.stage, args.tp_rank)
    code = run_logged(name, cfg, lambda: _serve(cfg, args, name))
    exit_now(code)   # the compute thread may sit in a blocking data-plane recv: leave without joining it


def _serve(cfg: Config, args: argparse.Namespace, name: str) -> int:
    n, tp = cfg.engine.n_workers, cfg.engine.tp_size
    log = setup_logging(name, cfg.log, stage=args.stage)
    use_threads(1)   # this thread sets up and runs the event loop; the compute thread builds and runs the model
    store = connect_store(cfg) if uses_store(cfg) else None
    device = worker_device(cfg, args.stage, args.tp_rank)   # cuda:i by placement (unverified here: CPU only)
    use_device(device)   # this thread's; the compute and KV swap threads set their own (runtime/device.py)
    # the data plane first: the stage's TP group must exist before the runner shards its weights
    # the timeout also bounds every recv and all-reduce: an iteration's peers are never that far apart
    data_plane = DataPlane(args.stage, n, device, store, args.tp_rank, tp, timeout=max(600.0, cfg.server.ready_timeout))

    def build() -> ModelRunner:   # on the compute thread
        runner = ModelRunner(cfg, stage=args.stage, n_stages=n, tp=data_plane.tp, device=device, agree=data_plane.agree_min)
        if policy_class(cfg.scheduler.policy).swaps_kv:  # copy the plans' KV offloads/uploads on their own thread
            runner.start_swap_thread()
        use_threads(cfg.engine.threads_per_worker)   # the process's last set_num_threads (threads.py)
        log.info("stage loaded", n_stages=n, tp_rank=args.tp_rank, tp_size=tp, threads=torch.get_num_threads(),
                 device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."), requested_dtype=cfg.model.dtype)
        return runner

    controller = Controller(cfg, name, args.stage, args.tp_rank, args.run_dir, log, store)
    code = uvloop.run(controller.run(build, data_plane, device))
    log.info("worker stopped", exit_code=code)
    return code


if __name__ == "__main__":
    main()
