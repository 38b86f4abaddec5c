"""Async scheduling (`scheduler.async_scheduling`): iteration i+1 is planned while i computes, its
decodes fed the tokens i samples, on the device. The scheduler side against an engine that checks
every position and fills placeholders as the real one does; then the real engine, offline and
served, giving the tokens it gives without it."""
from __future__ import annotations

import random
import zlib
from collections import deque

import pytest

from orca_mq import LLM, SamplingParams
from orca_mq.config import load_config
from orca_mq.models.info import ModelInfo
from orca_mq.protocol.iteration import IterationPlan, IterationResult
from orca_mq.sched import make_scheduler
from orca_mq.sched.request import Request

INFO = ModelInfo(path="", arch="llama", vocab_size=1000, hidden_size=8, n_layers=2, n_heads=2, n_kv_heads=1,
                 intermediate_size=16, norm_eps=1e-5, context_length=4096, eos_token_ids=[2])


class Engine:
    """Token = a hash of (request, position, the token fed there); it keeps each request's KV length
    and checks that every row starts where that request's KV ends, and fills a placeholder from the
    previous iteration's sampled tokens (rows that follow anything else fail)."""

    def __init__(self) -> None:
        self.kv: dict[str, int] = {}
        self.last: tuple[int, list[int]] | None = None

    def run(self, plan: IterationPlan) -> IterationResult:
        sampled, out, failed = [], [], []
        for s in plan.seqs:
            tokens = list(s.token_ids)
            if s.prev_row >= 0:
                assert self.last is not None and self.last[0] == plan.follows, "a row follows an iteration not the last"
                tokens[0] = self.last[1][s.prev_row]
            assert s.start_pos == self.kv.get(s.request_id, 0), f"{s.request_id} fed at {s.start_pos}, KV holds {self.kv.get(s.request_id)}"
            self.kv[s.request_id] = s.seq_len
            # crc32, not hash(): str hashes change per process (PYTHONHASHSEED), and so would whether any request stops
            token = 3 + zlib.crc32(f"{s.request_id}/{s.seq_len}/{tokens[-1]}".encode()) % 997
            if token % 13 == 0:
                token = 2   # EOS now and then: requests that do not ignore it stop early
            out.append(token if s.sample else -1)
            if s.sample:
                sampled.append(token)
        self.last = (plan.iteration, sampled)
        return IterationResult(plan.iteration, out, failed)


def _drive(ahead: str, reqs: list[Request], max_bs: int, budget: int) -> dict[str, tuple[list[int], str | None]]:
    cfg = load_config(overrides={"scheduler.async_scheduling": ahead, "scheduler.max_bs": max_bs, "engine.block_size": 4,
                                 "engine.n_slots": 4096, "scheduler.max_num_batched_tokens": budget})
    sched, engine = make_scheduler(cfg, INFO), Engine()
    assert sched.depth == (2 if ahead == "on" else 1)
    for r in reqs:
        sched.add(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    done: dict[str, tuple[list[int], str | None]] = {}
    in_flight: deque[IterationPlan] = deque()
    results: list[IterationResult] = []
    while True:
        out = sched.step(0.0, results)
        for e in out.events:
            tokens[e.request_id] += [] if e.token_id is None else [e.token_id]
            if e.finish_reason:
                assert e.request_id not in done, "one final per request"
                done[e.request_id] = (tokens[e.request_id], e.finish_reason)
        in_flight.extend(out.plans)
        assert len(in_flight) <= sched.depth
        if len(in_flight) == 2:   # planned ahead: its placeholders follow the plan before it, and only those
            first, second = in_flight
            assert {s.request_id for s in second.seqs if s.prev_row >= 0} <= {s.request_id for s in first.seqs}
        if not in_flight:
            assert not sched.has_work()
            break
        results = [engine.run(in_flight.popleft())]
    bm = sched.block_manager
    assert bm.num_used_slots == 0 and bm.n_rsrv == 0 and bm.num_free_blocks == bm.num_blocks   # every block came back
    return done


@pytest.mark.parametrize("max_bs,budget", [(4, 0), (8, 16), (3, 7)])
def test_planning_ahead_changes_no_token(max_bs: int, budget: int) -> None:
    rng = random.Random(max_bs * 100 + budget)
    specs = [(rng.randint(1, 30), rng.randint(1, 12), rng.random() < 0.5) for _ in range(20)]

    def reqs() -> list[Request]:
        return [Request(f"r{i}", [5 + i] * n, SamplingParams(max_tokens=m, temperature=0, ignore_eos=ign), arrival=float(i))
                for i, (n, m, ign) in enumerate(specs)]

    sync, ahead = _drive("off", reqs(), max_bs, budget), _drive("on", reqs(), max_bs, budget)
    assert ahead == sync and len(sync) == len(specs)
    assert any(reason == "stop" for _, reason in sync.values())   # early stops happened, and cost nothing but a row


def test_policies_that_cannot_plan_ahead_refuse_on() -> None:
    for policy in ("fastserve", "request"):
        cfg = load_config(overrides={"scheduler.async_scheduling": "on", "scheduler.policy": policy})
        with pytest.raises(ValueError, match="cannot plan"):
            make_scheduler(cfg, INFO)
    with pytest.raises(ValueError, match="one worker"):
        load_config(overrides={"scheduler.async_scheduling": "on", "engine.n_workers": 2})
    assert make_scheduler(load_config(overrides={"scheduler.policy": "fastserve"}), INFO).depth == 1


def test_offline_engine_gives_the_same_tokens(tiny_served_dir) -> None:
    """The real engine, fp32, greedy: planned ahead (placeholders filled on the device), with and
    without the graph path's padded buffers, the same tokens as one iteration at a time; stop
    tokens end requests early mid-flight."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 40))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0,
                             stop_token_ids=rng.sample(range(3, 500), 40)) for _ in prompts]
    params[0] = SamplingParams(max_tokens=9, temperature=0.8, seed=5)   # a seeded sampled row
    outs = {}
    for ahead, graphs in (("off", "off"), ("on", "off"), ("on", "on")):
        llm = LLM(model=str(tiny_served_dir), dtype="float32", max_bs=4, n_slots=2048, max_num_batched_tokens=32,
                  async_scheduling=ahead, cuda_graphs=graphs)
        assert llm.scheduler.ahead == (ahead == "on")
        outs[ahead, graphs] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
    assert outs["on", "off"] == outs["off", "off"] == outs["on", "on"]
    assert {r for _, r in outs["off", "off"]} == {"stop", "length"}
