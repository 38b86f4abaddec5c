"""FastServe scheduler on a fake clock and a fake engine (no model): skip-join MLFQ, preemption,
starvation, ENST-ordered offload/upload, and the KV policies.

The fake engine tags every KV slot with (request, position) and checks that each iteration reads
exactly its own earlier tags through its block table after applying the plan's swaps (offloads
first, then uploads, as every stage does): a lost, stale or misplaced KV block fails the test.
"""
from __future__ import annotations

import random
from collections import deque

import pytest

from orca_mq.kv.block_manager import BlockManager
from orca_mq.kv.pool import PoolSize
from orca_mq.config import Config
from orca_mq.sched.fastserve import FastServeScheduler, select_batch
from orca_mq.protocol.iteration import IterationPlan, IterationResult
from orca_mq.kv.policy import ProactiveKV, ReactiveKV
from orca_mq.sched.mlfq import SkipJoinMLFQ
from orca_mq.sched.profiler import IterationProfile, Profiler
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched.request import Request
from orca_mq.models.info import ModelInfo

INFO = ModelInfo("fake", "llama", 512, 64, 2, 4, 2, 128, 1e-5, 4096, eos_token_ids=[2])
# initiation: 1 ms per input token; increment: 10 ms at batch 1 .. 20 ms at batch 64
PROFILE = IterationProfile([(1, 0.001), (1000, 1.0)], [(1, 0.010), (64, 0.020)])
BS = 4  # block size


def make(**overrides) -> FastServeScheduler:
    cfg = Config()
    settings = {"engine.block_size": BS, "engine.n_slots": 64 * BS, "engine.host_slots": 1024 * BS, "scheduler.max_bs": 4,
                "fastserve.starve_limit": 1.0, "fastserve.min_free_blocks": 4, "fastserve.burst_queues": 2}
    for key, value in {**settings, **overrides}.items():
        cfg.set(key, value)
    return FastServeScheduler(cfg, INFO, PROFILE)


def req(rid: str, prompt: int, max_tokens: int, arrival: float = 0.0) -> Request:
    return Request(rid, [5] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival)


class FakeEngine:
    """KV pools as {block: [tag per slot]}; applies swaps like a stage, then checks and writes tags.
    A slot's tag is what its K/V depends on, the tokens up to its position (requests sharing a
    cached prefix read the same slots)."""

    def __init__(self, sched: FastServeScheduler) -> None:
        self.sched = sched
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def execute(self, plan: IterationPlan) -> IterationResult:
        for d, h in plan.swap_out:
            self.host[h] = list(self.device[d])
        for h, d in plan.swap_in:
            self.device[d] = list(self.host[h])
        for s in plan.seqs:
            req = self.sched.pool[s.request_id]
            tokens = req.prompt_token_ids + req.output_token_ids
            for pos in range(s.seq_len):
                block = self.device.setdefault(s.block_table[pos // BS], [None] * BS)
                tag = hash(tuple(tokens[:pos + 1]))
                if pos < s.start_pos:
                    assert block[pos % BS] == tag, f"iteration {plan.iteration}: {s.request_id} lost its KV at {pos}"
                else:
                    block[pos % BS] = tag
        return IterationResult(plan.iteration, [7] * len(plan.seqs))


def duration(plan: IterationPlan) -> float:
    return 0.010 + 0.001 * sum(len(s.token_ids) for s in plan.seqs if s.start_pos == 0)


def run(sched: FastServeScheduler, arrivals: list[Request], check=None) -> list[IterationPlan]:
    """Drive the scheduler's own loop (`step`) as the scheduler process does: arrivals at their times,
    up to n_workers plans in flight, results in order, the clock advancing by each iteration's duration."""
    engine, pending, in_flight, plans = FakeEngine(sched), deque(sorted(arrivals, key=lambda r: r.arrival)), deque(), []
    now, results = 0.0, []
    while True:
        while pending and pending[0].arrival <= now:
            sched.add(pending.popleft())
        for plan in sched.step(now, results).plans:
            assert not any(sched.block_manager.on_host(s.request_id) for s in plan.seqs), "a job ran with its KV on the host"
            if check:
                check(sched, plan)
            plans.append(plan)
            in_flight.append((plan, engine.execute(plan)))
        results = []
        if in_flight:
            plan, result = in_flight.popleft()
            now += duration(plan)
            results = [result]
        elif pending:
            now = pending[0].arrival
        elif sched.has_work():
            pytest.fail(f"stalled with work left: {sched.stats()}")
        else:
            return plans


def bursty(n: int, seed: int, rate: float = 40.0) -> list[Request]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate) if rng.random() < 0.7 else 0.0  # bursts of simultaneous arrivals
        out.append(req(f"r{i}", rng.choice([2, 5, 9, 30, 60]), rng.choice([1, 3, 8, 20, 40]), t))
    return out


def assert_exact_tables(sched: FastServeScheduler, plan: IterationPlan) -> None:
    """Every job of a plan holds just the blocks its tokens fill, and every idle job, on the device
    or the host, just those its written KV fills: no block is taken, or offloaded, unwritten."""
    bm = sched.block_manager
    assert all(len(q.block_table) == bm.blocks_for(q.seq_len) for q in plan.seqs)
    for tables in (bm.device.tables, bm.host.tables):
        for rid, table in tables.items():
            if not sched.pool[rid].running:   # not in this plan nor in flight
                assert len(table) == bm.blocks_for(sched.pool[rid].next_tokens(None)[1]), rid


def assert_clean(sched: FastServeScheduler) -> None:
    stats = sched.stats()
    assert stats["free_slots"] == stats["n_slots"] and stats["host_free_slots"] == stats["host_slots"]
    bm = sched.block_manager
    assert not bm.device.tables and not bm.host.tables and bm.n_rsrv == 0


# ---------------------------------------------------------------- MLFQ


def test_skip_join_places_jobs_by_predicted_first_iteration():
    sched = make(**{"engine.n_slots": 1024 * BS, "fastserve.n_queues": 6})   # 900 tokens fit no quantum: lowest queue
    q1 = PROFILE.increment_time(4)  # quantum of Q1 = one increment iteration at max_bs
    assert sched.mlfq.quanta == pytest.approx([q1 * 2**i for i in range(6)])
    for i, prompt in enumerate([5, 15, 30, 60, 150, 300, 900]):
        sched.add(req(f"j{i}", prompt, 4))
    assert [sched.request_metrics(f"j{i}")["join_queue"] for i in range(7)] == [1, 2, 3, 4, 5, 6, 6]


def test_demotion_after_the_quantum_and_token_level_preemption():
    sched = make()
    plans = run(sched, [req("a", 5, 12)])
    history = sched.request_metrics("a")["queue_history"]
    assert [(kind, q) for _, kind, q in history] == [("join", 1), ("demote", 2), ("demote", 3), ("demote", 4)]
    # Q1: initiation (5 ms) + 1 increment (10 ms) >= 10.5 ms; Q2: 3 increments >= 21 ms; Q3: 5 >= 42 ms
    ends = [sum(duration(p) for p in plans[: i + 1]) for i in range(len(plans))]
    assert [t for t, _, _ in history[1:]] == pytest.approx([ends[1], ends[4], ends[9]])


def test_a_short_job_preempts_a_long_one_at_the_next_iteration():
    sched = make(**{"scheduler.max_bs": 1})
    plans = run(sched, [req("long", 5, 40), req("short", 5, 3, arrival=0.1)])
    order = [p.seqs[0].request_id for p in plans]
    first_short = order.index("short")
    assert order[first_short: first_short + 3] == ["short"] * 3 and "long" in order[first_short + 3:]
    assert plans[first_short].iteration - 1 == max(p.iteration for p in plans[:first_short])
    assert sum(duration(p) for p in plans[:first_short]) <= 0.1 + 0.011  # joined at the first iteration after arrival


def test_starvation_promotion_with_extra_quantum():
    mlfq = SkipJoinMLFQ(n_queues=4, quantum=0.1, ratio=2.0, starve_limit=1.0)
    x = req("x", 1, 1)
    mlfq.join(x, first_iteration_time=0.5, now=0.0)           # skip-joins Q4: 0.4 < 0.5 <= 0.8
    assert x.job.queue == 3
    assert not mlfq.promote_starved(x, 0.5, now=1.0)          # not yet longer than starve_limit
    assert mlfq.promote_starved(x, 0.5, now=1.01)
    job = x.job
    assert (job.queue, job.budget) == (0, 0.5)   # its next iteration (0.5 s) fits: extra quantum over Q1's 0.1
    mlfq.charge(x, 0.5, next_iteration_time=0.05, now=1.6)
    assert job.queue == 1 and [k for _, k, _ in job.history] == ["join", "promote", "demote"]


def test_no_starvation_of_a_long_job_under_a_stream_of_short_ones():
    def long_runs(starve_limit: float) -> tuple[list[float], FastServeScheduler]:
        """End times of the long job's iterations while 3 s of short Q1 jobs keep arriving."""
        # no prefix caching: the short prompts would be cache hits of the long one's, and cost no prefill
        sched = make(**{"scheduler.max_bs": 1, "fastserve.starve_limit": starve_limit, "engine.prefix_caching": False})
        shorts = [req(f"s{i}", 5, 2, arrival=0.022 * i) for i in range(140)]   # 25 ms of work every 22 ms
        t, ends = 0.0, []
        for p in run(sched, [req("long", 60, 30), *shorts]):
            t += duration(p)
            if p.seqs[0].request_id == "long":
                ends.append(t)
        return [e for e in ends if e < 3.0], sched

    ends, sched = long_runs(starve_limit=0.5)
    assert len(ends) >= 3 and sched.request_metrics("long")["promotions"] >= 3
    assert all(b - a < 0.5 + 0.5 for a, b in zip([0.0, *ends], ends))   # starve_limit + draining Q1 ahead of it
    assert long_runs(starve_limit=100.0)[0] == []   # without promotion the stream starves it


@pytest.mark.parametrize("policy", ["reactive", "proactive"])
def test_a_preempted_job_on_the_host_is_not_starved_by_a_stream_of_new_ones(policy: str):
    """A long job preempted to the host waits for room to come back; new jobs behind it in priority
    order (it is promoted to Q1's head) may not take that room, or a steady stream of short ones, each
    fitting beside the others, keeps it on the host for as long as the stream lasts."""
    sched = make(**{"engine.n_slots": 16 * BS, "engine.host_slots": 64 * BS, "fastserve.kv_policy": policy,
                    "fastserve.starve_limit": 0.1, "fastserve.min_free_blocks": 0, "fastserve.burst_queues": 0,
                    "fastserve.preempt_margin": 0.0, "engine.prefix_caching": False})
    long = req("long", 4, 44)                                                    # 12 of the 16 blocks
    shorts = [req(f"s{i}", 4, 8, arrival=0.05 + 0.03 * i) for i in range(100)]   # 3 blocks each, for 3 s
    t, ends = 0.0, [0.0]
    for p in run(sched, [long, *shorts]):
        t += duration(p)
        if any(s.request_id == "long" for s in p.seqs):
            ends.append(t)
    metrics = sched.request_metrics("long")
    assert metrics["offloads"] >= 1 and metrics["promotions"] >= 1   # it was preempted to the host
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    assert ends[-1] < 3.0 and max(gaps) < 0.5, (ends[-1], max(gaps))   # it runs while the stream lasts
    assert_clean(sched)


def test_enst_is_min_of_promotion_and_execution_time():
    mlfq = SkipJoinMLFQ(n_queues=6, quantum=0.1, ratio=2.0, starve_limit=10.0)
    jobs = [req(rid, 1, 1) for rid in "abcd"]
    mlfq.join(jobs[0], 0.05, now=9.0)    # Q1
    mlfq.join(jobs[1], 0.3, now=9.4)     # Q3
    mlfq.join(jobs[2], 5.0, now=0.0)     # Q6, close to promotion
    mlfq.join(jobs[3], 5.0, now=9.0)     # Q6
    enst = mlfq.enst(jobs, max_bs=1, now=9.5)
    assert enst["a"] == 0.0                                   # nothing ahead
    assert enst["b"] == pytest.approx(0.1 + 0.2)              # a: rest of Q1 + Q2
    assert enst["c"] == pytest.approx(0.5)                    # T_promote (execution: 3.1 + 2.8)
    assert enst["d"] == pytest.approx(0.1 + 0.2 + 0.4 + 0.8 + 1.6 + 0.4 + 0.8 + 1.6 + 3.2)  # a + b + c ahead
    assert mlfq.enst(jobs, max_bs=2, now=9.5)["b"] == 0.0   # runs in the next batch


# ---------------------------------------------------------------- KV policies


class Expect:
    """Expected remaining service by request id (FastServe learns it; here it is given)."""

    def __init__(self, remaining: dict[str, float] | None = None, new_job: float = 1.0) -> None:
        self.remaining, self.new_job = remaining or {}, new_job

    def remaining_s(self, req: Request) -> float:
        return self.remaining.get(req.request_id, 10.0)

    def new_job_s(self) -> float:
        return self.new_job


def teach_heavy_tail(sched: FastServeScheduler) -> None:
    """Lengths where a job that has run is likely to run long (most end at once, a few go on): the law
    under which preempting a started job for a new one pays."""
    for n in [1] * 90 + [400] * 10:
        sched.lengths.observe(n, True)
    sched.lengths.refresh([])


def _resident(bm: BlockManager, *jobs: tuple[str, int]) -> list[Request]:
    out = []
    for rid, n_tokens in jobs:
        r = req(rid, n_tokens, 8)
        r.output_token_ids.append(7)
        r.phase = r.phase.INCREMENT
        bm.ensure(rid, r.num_tokens)
        out.append(r)
    return out


def test_offload_picks_the_largest_enst_and_upload_the_smallest():
    """A job that needs room takes it from idle resident jobs of lower priority, largest ENST first;
    proactive uploads the smallest-ENST job on the host ahead of time, while room stays reserved."""
    bm = BlockManager(PoolSize(BS, 12, 100))
    kv = ReactiveKV(bm, expect=Expect({"n": 1.0}), margin=2.0)
    x, y, z = _resident(bm, ("x", 10), ("y", 10), ("z", 10))   # 3 blocks each, 4 reserved each: no room left
    for r in (x, y, z):
        bm.reserve(r, 4)
    new, y_blocks = req("n", 8, 4), bm.table("y")
    batch = select_batch(kv, [new, x, y, z], {"n": 0.0, "x": 5.0, "y": 9.0, "z": 1.0}, max_bs=4, reserve=0)
    assert batch == [new, x, z] and bm.on_host("y") and not bm.on_host("x") and not bm.on_host("z")
    assert y.reserved_blocks == 0 and bm.n_rsrv == 4 + 4 + 3   # y no longer resident; n reserved its 3
    swap_out, swap_in = kv.take_swaps()
    assert swap_out == list(zip(y_blocks, bm.host.tables["y"])) and not swap_in

    bm = BlockManager(PoolSize(BS, 12, 100))
    kv = ProactiveKV(bm, expect=Expect(), margin=2.0)
    a, b, c = _resident(bm, ("a", 10), ("b", 10), ("c", 10))
    for r in (a, b, c):
        bm.reserve(r, 4)
    for r in (b, c):
        kv.offload(r)
    kv.take_swaps()
    batch = select_batch(kv, [a, b, c], {"a": 0.0, "b": 3.0, "c": 1.0}, max_bs=1, reserve=2)
    assert batch == [a]
    assert bm.on_host("b") and not bm.on_host("c")  # c (smaller ENST) uploaded ahead; room for one only
    swap_out, swap_in = kv.take_swaps()
    assert not swap_out and {d for _, d in swap_in} == set(bm.table("c"))


def test_a_lower_priority_job_never_takes_room_from_a_higher_one():
    """Victims come only from below the job that needs room; with none there it waits (and, new, stops
    later new jobs from starting ahead of it)."""
    bm = BlockManager(PoolSize(BS, 8, 100))
    kv = ReactiveKV(bm, expect=Expect({"big": 1.0, "small": 1.0}), margin=2.0)
    (x,) = _resident(bm, ("x", 10))
    bm.reserve(x, 8)                                      # the whole pool
    big, small = req("big", 8, 4), req("small", 2, 1)
    batch = select_batch(kv, [x, big, small], {"x": 0.0, "big": 1.0, "small": 2.0}, max_bs=4, reserve=0)
    assert batch == [x] and not bm.on_host("x") and not big.reserved_blocks and not small.reserved_blocks


def test_proactive_keeps_free_blocks_for_arrivals_reactive_does_not():
    for cls, offloaded in ((ProactiveKV, True), (ReactiveKV, False)):
        bm = BlockManager(PoolSize(BS, 12, 100))
        kv = cls(bm, expect=Expect(), margin=2.0)
        a, b, c = _resident(bm, ("a", 10), ("b", 10), ("c", 10))
        for r in (a, b, c):
            bm.reserve(r, 4)
        assert select_batch(kv, [a, b, c], {"a": 0.0, "b": 2.0, "c": 1.0}, max_bs=1, reserve=3) == [a]
        assert bm.on_host("b") is offloaded and not bm.on_host("c")
        assert (kv.room >= 3) is offloaded


@pytest.mark.parametrize("policy", ["proactive", "reactive", "defer"])
@pytest.mark.parametrize("n_workers", [1, 2])
def test_bursty_load_keeps_every_kv_and_frees_both_pools(policy: str, n_workers: int):
    sched = make(**{"fastserve.kv_policy": policy, "engine.n_workers": n_workers, "engine.n_slots": 40 * BS})
    reserved_max = []

    def check(s: FastServeScheduler, plan: IterationPlan) -> None:
        reserved_max.append(s.block_manager.n_rsrv)
        assert_exact_tables(s, plan)
        if policy == "defer":   # no job's KV moves (cached blocks may: the host is the prefix cache's second tier)
            assert not s.block_manager.host.tables
        if policy == "reactive":  # uploads only for the plan's own jobs: no prefetch
            assert {d for _, d in plan.swap_in} <= {b for q in plan.seqs for b in q.block_table}

    teach_heavy_tail(sched)   # started jobs are expected to run long: arrivals may take their room
    arrivals = bursty(80, seed=n_workers)
    plans = run(sched, arrivals, check)
    assert {r.request_id for r in arrivals} == {rid for p in plans for rid in (q.request_id for q in p.seqs)}
    assert all(sched.request_metrics(r.request_id) is not None for r in arrivals)
    assert_clean(sched)
    offloads = sum(sched.request_metrics(r.request_id)["offloads"] for r in arrivals)
    prefetched = sum(len({d for _, d in p.swap_in} - {b for q in p.seqs for b in q.block_table}) for p in plans)
    assert max(reserved_max) <= 40   # the resident jobs' reservations never outgrow the device pool
    if policy == "defer":
        assert offloads == 0
    else:
        assert offloads > 0   # arrivals of higher priority took room from idle jobs
        assert policy == "proactive" or prefetched == 0
        m = next(sched.request_metrics(r.request_id) for r in arrivals if sched.request_metrics(r.request_id)["offloads"])
        assert m["offload_bytes"] == m["offload_bytes"] // sched.block_bytes * sched.block_bytes > 0


def test_defer_new_jobs_wait_for_free_blocks():
    sched = make(**{"fastserve.kv_policy": "defer", "engine.n_slots": 16 * BS})
    plans = run(sched, [req("big", 8, 40), req("next", 8, 16, arrival=0.001)])   # 12 + 6 blocks > 16
    first_next = next(i for i, p in enumerate(plans) if p.seqs[0].request_id == "next")
    assert all(p.seqs[0].request_id == "big" for p in plans[:first_next]) and len(plans[:first_next]) == 40
    assert_clean(sched)


def test_full_host_pool_makes_new_jobs_wait_and_loses_nothing():
    sched = make(**{"engine.n_slots": 28 * BS, "engine.host_slots": 8 * BS})   # host smaller than the device
    arrivals = bursty(40, seed=3)
    run(sched, arrivals)
    assert all(sched.request_metrics(r.request_id) is not None for r in arrivals)
    assert_clean(sched)


def test_abort_frees_the_host_copy_and_keeps_metrics():
    sched = make(**{"scheduler.max_bs": 1, "engine.n_slots": 8 * BS, "fastserve.min_free_blocks": 0,
                    "fastserve.burst_queues": 0})
    teach_heavy_tail(sched)
    engine, now = FakeEngine(sched), 0.0
    sched.add(req("a", 20, 8))
    sched.process_result(engine.execute(sched.schedule(now)), now := now + 0.02)   # a holds 5 of 8 blocks
    sched.add(req("b", 13, 4, arrival=now))                                     # b needs 4: a is offloaded
    plan = sched.schedule(now)
    assert [s.request_id for s in plan.seqs] == ["b"] and sched.block_manager.on_host("a") and plan.swap_out
    sched.process_result(engine.execute(plan), now + 0.02)
    assert sched.request_metrics("a")["offloads"] == 1                          # live: read off the request
    assert sched.abort("a") and sched.request_metrics("a")["offloads"] == 1
    assert sched.block_manager.num_free_host_blocks == sched.block_manager.num_host_blocks
    with pytest.raises(ValueError):
        sched.add(req("huge", 40, 1))   # more KV than the device pool can ever hold


def test_probes_run_through_the_loop_first_and_requests_wait_for_the_profile():
    """The profile's probe iterations go through `step()` one at a time before any request; a request
    arriving meanwhile waits (it is skip-joined with the measured profile) and can be aborted."""
    cfg = Config()
    for key, value in {"engine.block_size": 16, "engine.n_slots": 64 * 16, "scheduler.max_bs": 8,
                       "fastserve.profile_max_len": 300}.items():
        cfg.set(key, value)
    sched = FastServeScheduler(cfg, INFO)
    sched.add(req("early", 20, 2))
    sched.add(req("gone", 20, 2))
    assert sched.has_work() and not sched.pool and sched.abort("gone")[0].finish_reason == "abort"
    seen: list[IterationPlan] = []
    now, results = 0.0, []
    while not seen or seen[-1].iteration < 0:
        out = sched.step(now, results)
        assert len(out.plans) == 1 and not out.events      # timed alone
        seen.append(out.plans[0])
        now += 0.01 * (len(seen) % 7 + 1)
        results = [IterationResult(out.plans[0].iteration, [0] * len(out.plans[0].seqs))]
    prof, first = sched.profile, seen.pop()   # the turn that ends the probes already plans the first request
    assert prof is not None and sched.pool.keys() == {"early"} and [s.request_id for s in first.seqs] == ["early"]
    assert [x for x, _ in prof.initiation] == [1, 16, 32, 64, 128, 256, 300]
    assert [x for x, _ in prof.increment] == [1, 2, 4, 8]
    assert all(p.iteration < 0 for p in seen) and all(max(b for s in p.seqs for b in s.block_table) < 64 for p in seen)
    assert all(t1 >= t0 for (_, t0), (_, t1) in zip(prof.initiation, prof.initiation[1:]))  # monotone
    p = IterationProfile([(1, 0.01), (101, 0.11)], [(1, 0.02), (5, 0.03)])
    assert p.initiation_time(51) == pytest.approx(0.06) and p.initiation_time(201) == pytest.approx(0.21)
    assert p.increment_time(3) == pytest.approx(0.025)
    assert IterationProfile.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("block_size, blocks", [(16, 4), (4, 3), (1, 2)])
def test_a_pool_smaller_than_one_increment_probe_still_profiles(block_size: int, blocks: int):
    """A pool under the increment probes' context of 64 tokens (a test's, a tiny device's) still gets an
    increment probe, shorter, inside the pool (it had none, and fitting the profile failed)."""
    prof = Profiler(block_size, blocks, max_len=4096, max_bs=8, repeats=1)
    kinds = {prof._what[p.iteration][0] for p in prof.plans if p.iteration in prof._what}
    assert kinds == {"initiation", "increment"}
    assert all(b < blocks for p in prof.plans for s in p.seqs for b in s.block_table)
    assert all(len(s.block_table) * block_size >= s.start_pos + len(s.token_ids) for p in prof.plans for s in p.seqs)
    now = 0.0
    while (plan := prof.next_plan(now)) is not None:
        now += 0.01
        done = prof.finish(now)
    assert done is not None and done.increment and done.initiation


def test_token_budget_skip_join_and_charges_use_the_prompt_chunk():
    """Under a token budget a job's next iteration is its next prompt chunk: skip-join places it by
    the chunk's time, and each chunk iteration is charged the chunk's time, not the whole prompt's."""
    sched = make(**{"engine.n_slots": 1024 * BS, "fastserve.n_queues": 6, "scheduler.max_num_batched_tokens": 16})
    sched.add(req("long", 900, 4))
    assert sched.request_metrics("long")["join_queue"] == 2     # 16 ms chunk: Q2 (quantum 2 x 10.1 ms), not Q6
    plans = run(sched, [])
    chunks = [s.token_ids for p in plans for s in p.seqs if s.start_pos < 900]
    assert [len(c) for c in chunks] == [16] * 56 + [4]
    history = sched.finished["long"]["queue_history"]
    # charged 16 ms a chunk, it uses Q2's 20.2 ms after two chunks (whole-prompt charging: after one),
    # then sinks to the last queue
    assert history[1][1:] == ["demote", 3] and history[1][0] == pytest.approx(duration(plans[0]) + duration(plans[1]))
    assert sched.finished["long"]["demotions"] == 4


@pytest.mark.parametrize("policy", ["proactive", "defer"])
@pytest.mark.parametrize("seed", [5, 81])
def test_token_budget_bursty_load_keeps_every_kv(policy: str, seed: int):
    sched = make(**{"fastserve.kv_policy": policy, "engine.n_slots": 40 * BS, "scheduler.max_num_batched_tokens": 8})

    def check(s: FastServeScheduler, plan: IterationPlan) -> None:
        increments = sum(q.start_pos >= len(s.pool[q.request_id].prompt_token_ids) for q in plan.seqs)
        assert plan.num_tokens <= max(8, increments)
        assert_exact_tables(s, plan)   # a chunked prompt's blocks cover the chunk it was given, no more

    arrivals = bursty(80, seed=seed)
    plans = run(sched, arrivals, check)
    assert any(q.start_pos and len(q.token_ids) > 1 for p in plans for q in p.seqs)   # prompts were chunked
    assert all(sched.request_metrics(r.request_id) is not None for r in arrivals)
    assert_clean(sched)
