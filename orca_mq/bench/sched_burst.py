"""The scheduler process's work for one served burst, in one process and by part (tools/bench_scheduler.py
--burst): a policy's `apply` and `step`, the plan packed and encoded, the worker's result decoded, the
frontend's token frame built and encoded, as SchedulerProcess takes them each turn, with no sockets, event
loop or other processes. `evict_mb` > 0 streams that much memory between iterations, as the served
processes around it (the worker's iteration above all) do: what the scheduler then touches comes from
memory, which is most of its cost when served (tools/bench_control_plane.py)."""
from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from orca_mq.bench.plans import kv_room
from orca_mq.config import load_config
from orca_mq.models.info import ModelInfo
from orca_mq.protocol import decode, encode
from orca_mq.protocol.codec import channel
from orca_mq.protocol.engine_msgs import ControlFrame, IterationDone
from orca_mq.protocol.iteration import IterationResult, pack
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched import events_of, make_scheduler
from orca_mq.sched.request import Request
from orca_mq.server.scheduler_process import token_batch

PARTS = ("apply", "step", "plan encode", "result decode", "token frame")
RESULTS = channel(IterationDone)


def burst(info: ModelInfo, requests: int, max_bs: int, budget: int, input_len: tuple[int, int], output_len: int,
          evict_mb: int, seed: int, policy: str = "orca") -> dict[str, Any]:
    """CPU microseconds per generated token of each part, over the burst (every request sent at once,
    `output_len` tokens each, ignoring EOS), prefix caching on as served."""
    cfg = load_config(overrides={"scheduler.policy": policy, "scheduler.max_bs": max_bs, "scheduler.max_num_batched_tokens": budget,
                                 "engine.n_slots": kv_room(requests, input_len[1] + output_len, 16),
                                 "engine.block_size": 16})
    sched = make_scheduler(cfg, info)
    rng = random.Random(seed)
    for i in range(requests):
        prompt = [rng.randrange(3, info.vocab_size) for _ in range(rng.randint(*input_len))]
        sched.add(Request(f"#{i}", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0), arrival=0.0))
    sampled = [rng.randrange(3, info.vocab_size) for _ in range(max_bs)]
    spent, tokens, iterations = dict.fromkeys(PARTS, 0.0), 0, 0
    evict = np.ones(evict_mb * 2**20 // 8) if evict_mb else None
    clock, now, frames = time.process_time, 0.0, []
    while sched.has_work():
        t0 = clock()
        results = [decode(f, RESULTS).result for f in frames]
        t1 = clock()
        parts = [p for r in results for p in sched.apply(r, now)]
        t2 = clock()
        plans = sched.step(now).plans
        t3 = clock()
        for p in plans:
            encode(ControlFrame(pack(p), 0.0))
        t4 = clock()
        if parts:
            encode(token_batch(iterations, parts, sched.final_metrics))
        t5 = clock()
        for part, s in zip(PARTS, (t2 - t1, t3 - t2, t4 - t3, t1 - t0, t5 - t4)):
            spent[part] += s
        tokens += sum(e.token_id is not None for e in events_of(parts))
        iterations += bool(plans)
        frames = [encode(IterationDone(IterationResult(p.iteration, sampled[:len(p.request_ids)]), 0.0, 0.0))
                  for p in map(pack, plans)]   # the worker's answer: not the scheduler's work
        now += 0.01
        if evict is not None:
            evict *= 1.0
    return {"tokens": tokens, "iterations": iterations, "us_per_token": {k: v / tokens * 1e6 for k, v in spent.items()}}
