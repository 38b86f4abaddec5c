"""Entry point of one worker process: `python -m workers.main --stage I --run-dir D --config-json J`."""
from __future__ import annotations

import argparse
import json
import os

import torch
import uvloop

from orca_mq.config import Config
from orca_mq.logs import setup_logging
from orca_mq.sched import policy_class
from orca_mq.engine.model_runner import ModelRunner
from workers.controller import Controller
from workers.data_plane import DataPlane
from workers.kv_swap import KVSwapper


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="orca-mq worker (one pipeline stage)")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--run-dir", required=True, help="directory of the control sockets")
    args = parser.parse_args(argv)
    cfg = Config.from_dict(json.loads(args.config_json))
    n = cfg.engine.n_workers
    log = setup_logging(f"worker{args.stage}", cfg.log, stage=args.stage)
    torch.set_num_threads(cfg.engine.threads_per_worker)
    runner = ModelRunner(cfg, stage=args.stage, n_stages=n)
    if policy_class(cfg.scheduler.policy).swaps_kv:  # copy the plans' KV offloads/uploads on their own thread
        runner.swapper = KVSwapper(runner.kv, runner.host_blocks)
    data_plane = DataPlane(args.stage, n, cfg.server.worker_base_port, runner.device)
    log.info("stage loaded", n_stages=n, threads=torch.get_num_threads(), device=str(runner.device))
    code = uvloop.run(Controller(cfg, args.stage, args.run_dir, log).run(runner, data_plane))
    log.info("worker stopped", exit_code=code)
    # the compute thread may sit in a blocking data-plane recv: leave without joining it
    os._exit(code)


if __name__ == "__main__":
    main()
