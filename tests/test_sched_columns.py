"""The columnar planner (orca_mq/sched/columns.py) plans what the general path plans: every policy, on a
random workload (shared prompt prefixes, EOS and stop tokens, seeds, requests that need rows of their own,
aborts, engine failures, async scheduling), run twice in lockstep, with and without it. Every packed plan
is equal field by field, and every request's events; most plans must have gone through the columnar planner (whole,
or its decode rows merged with the general path's other rows)."""
from __future__ import annotations

import random
from collections import deque
from dataclasses import fields

import pytest

from orca_mq.config import load_config
from orca_mq.models.info import ModelInfo
from orca_mq.protocol.iteration import IterationPlan, IterationResult, pack
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched import TokenColumns, TokenEvent, make_scheduler
from orca_mq.sched import base
from orca_mq.sched.base import Scheduler
from orca_mq.sched.profiler import IterationProfile
from orca_mq.sched.request import Request

INFO = ModelInfo(path="m", arch="llama", vocab_size=1000, hidden_size=8, n_layers=2, n_heads=2, n_kv_heads=1,
                 intermediate_size=16, norm_eps=1e-5, context_length=4096, eos_token_ids=[2, 5])
PROFILE = IterationProfile([(1, 0.001), (1000, 1.0)], [(1, 0.010), (64, 0.020)])
# (policy, async scheduling, pipeline stages, KV slots); the request-level baseline's requests all ignore EOS and
# make 30 tokens (its batches run until every member finished); FastServe in a small pool offloads decoding
# requests' KV and uploads it again (their tables come back as other lists)
CASES = [("orca", "off", 1, 2048), ("orca", "on", 1, 2048), ("orca", "off", 2, 2048), ("request", "off", 1, 2048),
         ("srpt", "off", 1, 2048), ("fastserve", "off", 1, 2048), ("fastserve", "off", 1, 160)]


def workload(seed: int, uniform: bool) -> list[tuple[float, Request]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(6, 1000) for _ in range(12)]
    out = []
    for i in range(40):
        kind = rng.random()
        params = SamplingParams(max_tokens=30 if uniform else rng.randint(1, 40), ignore_eos=uniform or rng.random() < 0.5,
                                temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]),
                                seed=rng.choice([None, 0, 7, 2**62]), stop_token_ids=[9, 11] if kind < 0.2 else [],
                                logprobs=2 if 0.2 <= kind < 0.24 else None, presence_penalty=0.5 if 0.24 <= kind < 0.27 else 0.0)
        prompt = (prefix if rng.random() < 0.5 else []) + [rng.randrange(6, 1000) for _ in range(rng.randint(1, 20))]
        out.append((rng.random() * 0.3, Request(f"r{i}", prompt, params, arrival=0.0, client=rng.choice(["a", "b"]))))
    return sorted(out, key=lambda x: x[0])


def result(plan: IterationPlan, rng: random.Random, last: list[int]) -> IterationResult:
    """Random tokens (EOS and stop tokens among them), a failed row now and then."""
    rows = plan.seqs
    tokens = [rng.choice([2, 9, rng.randrange(6, 1000), rng.randrange(6, 1000)]) if s.sample else -1 for s in rows]
    failed = [rows[0].request_id] if rows and rng.random() < 0.03 else []
    return IterationResult(plan.iteration, tokens, failed,
                           logprob_rows=[], logprobs=[])


def by_request(events: list[TokenEvent]) -> dict[str, list[tuple[int | None, str | None]]]:
    """Each request's events in order (what its stream sees: a merged iteration's decode rows, applied in
    columns, come before its general rows, so the order across requests differs)."""
    out: dict[str, list[tuple[int | None, str | None]]] = {}
    for e in events:
        out.setdefault(e.request_id, []).append((e.token_id, e.finish_reason))
    return out


def same_plan(a: IterationPlan, b: IterationPlan) -> None:
    """Equal columns, and equal rows as objects (as tests and tools read them), packed again."""
    for pa, pb in ((pack(a), pack(b)), (pack(IterationPlan(0, a.seqs)), pack(IterationPlan(0, b.seqs)))):
        for f in fields(pa):
            assert getattr(pa, f.name) == getattr(pb, f.name), f"iteration {a.iteration}: column {f.name} differs"


@pytest.mark.parametrize("client_rows", [0, 2])   # two clients' requests: with a cap, batches hold some back
@pytest.mark.parametrize("policy,ahead,workers,slots", CASES)
def test_columnar_plans_equal_the_general_path(policy: str, ahead: str, workers: int, slots: int, client_rows: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(overrides={"scheduler.policy": policy, "scheduler.async_scheduling": ahead, "engine.n_workers": workers,
                                 "scheduler.max_bs": 8, "scheduler.max_num_batched_tokens": 32, "engine.block_size": 4,
                                 "engine.n_slots": slots, "engine.host_slots": 1024, "scheduler.client_rows": client_rows})
    pair: list[Scheduler] = [make_scheduler(cfg, INFO), make_scheduler(cfg, INFO)]
    pair[1].columns = None   # the general path only
    for s in pair:
        if s.needs_profile:
            s.use_profile(PROFILE)
    arrivals = deque(workload(len(policy + ahead) + workers, policy == "request"))
    rng, now, columnar, total = random.Random(1), 0.0, 0, 0
    was_merged = False
    merged = [0, 0]   # results of merged plans returned, and those whose decode rows were applied in columns
    in_columns: list[int] = []   # rows of each apply in columns
    apply_decode = base.apply_decode

    def counted(sched: Scheduler, batch: list[Request], *args: object) -> TokenColumns | None:
        if (out := apply_decode(sched, batch, *args)) is not None:   # type: ignore[arg-type]
            in_columns.append(len(batch))
        return out

    monkeypatch.setattr(base, "apply_decode", counted)
    flights: list[deque[IterationPlan]] = [deque(), deque()]
    results: list[list[IterationResult]] = [[], []]
    while arrivals or any(s.has_work() for s in pair):
        while arrivals and arrivals[0][0] <= now:
            _, req = arrivals.popleft()
            for s in pair:
                s.add(Request(req.request_id, list(req.prompt_token_ids), req.params, arrival=now, client=req.client))
        if rng.random() < 0.02 and pair[0].pool:   # an abort, of the same request in both
            victim = rng.choice(sorted(pair[0].pool))
            assert [(e.request_id, e.finish_reason) for e in pair[0].abort(victim)] == \
                [(e.request_id, e.finish_reason) for e in pair[1].abort(victim)]
        applied = len(in_columns)
        outs = [s.step(now, r) for s, r in zip(pair, results)]
        if results[0] and was_merged:
            merged[0] += 1
            merged[1] += len(in_columns) > applied
        assert by_request(outs[0].events) == by_request(outs[1].events)
        assert len(outs[0].plans) == len(outs[1].plans)
        for a, b in zip(outs[0].plans, outs[1].plans):
            columnar += a.rows is None
            same_plan(a, b)
            total += 1
        for f, o in zip(flights, outs):
            f.extend(o.plans)
        results = [[], []]
        if flights[0]:
            state = rng.getstate()
            was_merged = bool(flights[0][0].kept)
            for i in (0, 1):
                rng.setstate(state)
                results[i] = [result(flights[i].popleft(), rng, [])]
        now += 0.01
    assert columnar >= total // 2, f"{columnar} of {total} iterations planned in columns"
    assert merged[1] >= merged[0] // 3 > 0, f"{merged[1]} of {merged[0]} merged iterations' decode rows applied in columns"
    for s in pair:
        bm = s.block_manager
        assert bm.n_rsrv == 0 and bm.num_used_slots == 0
    assert pair[0].block_manager.device.index == pair[1].block_manager.device.index   # the same blocks published
