"""ORCA Algorithm 1 and the request-level baseline, driven by a fake engine that returns token 100 + iteration."""
from __future__ import annotations

import pytest

from orca_mq.api.metrics import EngineCollector
from orca_mq.config import load_config
from orca_mq.protocol.iteration import IterationPlan, IterationResult
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched import Scheduler, make_scheduler
from orca_mq.sched.orca import OrcaScheduler
from orca_mq.sched.request_level import RequestLevelScheduler
from orca_mq.sched.request import Phase, Request
from orca_mq.models.info import ModelInfo

INFO = ModelInfo(path="", arch="llama", vocab_size=1000, hidden_size=8, n_layers=2, n_heads=2, n_kv_heads=1,
                 intermediate_size=16, norm_eps=1e-5, context_length=4096, eos_token_ids=[2])


def make(policy: str = "orca", **overrides) -> Scheduler:
    # the prompts here repeat one token: prefix caching (tested in test_prefix_caching.py) is off
    cfg = load_config(overrides={"scheduler.policy": policy, "engine.block_size": 4, "engine.n_slots": 1024,
                                 "engine.prefix_caching": False, **overrides})
    return make_scheduler(cfg, INFO)


def req(i: int, prompt_len: int = 5, max_tokens: int = 3, arrival: float | None = None, **params) -> Request:
    return Request(f"r{i}", [7] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   arrival=float(i) if arrival is None else arrival)


def finish(plan: IterationPlan, token: int | None = None) -> IterationResult:
    return IterationResult(plan.iteration, [token if token is not None else 100 + plan.iteration for _ in plan.seqs])


def run(sched: Scheduler, steps: int = 10_000, fail: frozenset[str] = frozenset()) -> list[tuple[str, int | None, str | None]]:
    """The scheduler's own loop against the fake engine, until no work is left; the requests in `fail`
    fail on the engine in their first iteration."""
    events, results = [], []
    for _ in range(steps):
        out = sched.step(0.0, results)
        events += [(e.request_id, e.token_id, e.finish_reason) for e in out.events]
        if not out.plans:
            assert not sched.has_work(), "work left but nothing schedulable: deadlock"
            break
        results = [finish(p) for p in out.plans]
        for r, p in zip(results, out.plans):
            r.failed = [s.request_id for s in p.seqs if s.request_id in fail]
        fail = frozenset()
    return events


def test_iteration_level_fcfs_holds_throughout():
    sched = make(max_bs=3)
    reqs = [req(i, prompt_len=3 + i, max_tokens=2 + (7 * i) % 5) for i in range(8)]
    for r in reqs:
        sched.add(r)
    iterations = {r.request_id: 0 for r in reqs}
    while sched.has_work():
        plan = sched.schedule(0.0)
        for s in plan.seqs:
            iterations[s.request_id] += 1
        sched.process_result(finish(plan), 0.0)
        # an earlier request has run at least as many iterations as a later one, unless it finished
        live = [r for r in reqs if r.phase is not Phase.FINISHED]
        for a, b in zip(live, live[1:]):
            assert iterations[a.request_id] >= iterations[b.request_id]
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)


def test_new_request_joins_at_next_iteration_and_finished_leaves_at_once():
    sched = make(max_bs=4)
    sched.add(req(0, max_tokens=1))
    sched.add(req(1, max_tokens=5))
    plan = sched.schedule(0.0)
    assert [s.request_id for s in plan.seqs] == ["r0", "r1"]
    assert [len(s.token_ids) for s in plan.seqs] == [5, 5] and all(s.start_pos == 0 for s in plan.seqs)
    events = sched.process_result(finish(plan), 0.0)
    assert ("r0", "length") in [(e.request_id, e.finish_reason) for e in events]  # returned at once
    assert sched.block_manager.table("r0") == []                                 # its KV freed at once
    sched.add(req(2, prompt_len=9))
    plan = sched.schedule(0.0)
    by_id = {s.request_id: s for s in plan.seqs}
    assert set(by_id) == {"r1", "r2"}                           # r0 left, r2 joined
    assert by_id["r1"].token_ids == [101] and by_id["r1"].start_pos == 5   # increment at its own position
    assert len(by_id["r2"].token_ids) == 9 and by_id["r2"].start_pos == 0  # initiation of the whole prompt


def test_reservation_limits_admission_without_deadlock():
    # 32 slots; each request reserves ceil((8+8)/4)*4 = 16 slots: at most two at a time
    sched = make(max_bs=8, **{"engine.n_slots": 32})
    for i in range(5):
        sched.add(req(i, prompt_len=8, max_tokens=8))
    plan = sched.schedule(0.0)
    assert [s.request_id for s in plan.seqs] == ["r0", "r1"]
    assert sched.block_manager.n_rsrv == 8   # blocks
    events = run_from(sched, plan)
    assert sorted({e[0] for e in events if e[2]}) == [f"r{i}" for i in range(5)]
    assert sched.block_manager.n_rsrv == 0 and sched.block_manager.num_free_blocks == 8


def run_from(sched: Scheduler, plan: IterationPlan) -> list:
    events = [(e.request_id, e.token_id, e.finish_reason) for e in sched.process_result(finish(plan), 0.0)]
    return events + run(sched)


def test_strict_fcfs_a_small_request_does_not_pass_a_large_one():
    sched = make(max_bs=8, **{"engine.n_slots": 32})
    sched.add(req(0, prompt_len=8, max_tokens=8))   # 16 slots
    sched.add(req(1, prompt_len=16, max_tokens=8))  # 24 slots: does not fit beside r0
    sched.add(req(2, prompt_len=2, max_tokens=2))   # would fit, but must wait behind r1
    plan = sched.schedule(0.0)
    assert [s.request_id for s in plan.seqs] == ["r0"]


def test_pipeline_keeps_n_workers_batches_in_flight():
    sched = make(max_bs=2, **{"engine.n_workers": 2})
    for i in range(4):
        sched.add(req(i))
    p1, p2 = sched.step(0.0).plans
    assert [s.request_id for s in p1.seqs] == ["r0", "r1"] and [s.request_id for s in p2.seqs] == ["r2", "r3"]
    assert sched.step(0.0).plans == []  # n_scheduled == n_workers: wait for one to return
    (p3,) = sched.step(0.0, [finish(p1)]).plans
    assert [s.request_id for s in p3.seqs] == ["r0", "r1"]  # running requests (r2, r3) are not candidates


def test_abort_waiting_and_running_requests_frees_kv():
    sched = make(max_bs=1)
    sched.add(req(0, max_tokens=10))
    sched.add(req(1))
    plan = sched.schedule(0.0)
    assert [e.finish_reason for e in sched.abort("r1")] == ["abort"]   # waiting: final event now
    assert sched.abort("r0") == []                         # running: when its iteration returns
    events = sched.process_result(finish(plan), 0.0)
    assert [(e.request_id, e.token_id, e.finish_reason) for e in events] == [("r0", None, "abort")]
    assert not sched.has_work() and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert sched.block_manager.n_rsrv == 0
    assert sched.abort("nope") == []


def test_stop_conditions():
    sched = make()
    sched.add(Request("eos", [5], SamplingParams(max_tokens=9)))
    sched.add(Request("ign", [5], SamplingParams(max_tokens=2, ignore_eos=True)))
    sched.add(Request("stop", [5], SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=[2])))
    plan = sched.schedule(0.0)
    events = {e.request_id: e.finish_reason for e in sched.process_result(finish(plan, token=2), 0.0)}
    assert events == {"eos": "stop", "ign": None, "stop": "stop"}


def test_request_level_baseline_runs_batches_to_completion():
    sched = make("request", max_bs=2)
    assert isinstance(sched, RequestLevelScheduler) and isinstance(make(), OrcaScheduler)
    sched.add(req(0, max_tokens=1))
    sched.add(req(1, max_tokens=4))
    plan = sched.schedule(0.0)
    assert sched.process_result(finish(plan), 0.0) == []    # r0 finished but does not return early
    held_slots = sched.block_manager.num_used_slots
    assert sched.abort("r0") == []                          # finished already: no second final message
    sched.add(req(2, max_tokens=1))
    seen = []
    while sched.has_work():
        plan = sched.schedule(0.0)
        seen.append([(s.request_id, s.start_pos) for s in plan.seqs])
        events = sched.process_result(finish(plan), 0.0)
        if ("r1", 7) in seen[-1]:
            assert {e.request_id for e in events if e.finish_reason} == {"r0", "r1"}
            assert [e.token_id for e in events if e.request_id == "r0"] == [101]   # its wasted iterations add nothing
        elif len(seen) < 4:
            assert events == [] and sched.block_manager.num_used_slots == held_slots  # r0's KV held meanwhile
    # r0 stays in the batch, inactive, rerunning its last position (5) until r1 finishes;
    # r2 never joins r1's batch; every slot is free at the end
    assert seen == [[("r0", 5), ("r1", 5)], [("r0", 5), ("r1", 6)], [("r0", 5), ("r1", 7)], [("r2", 0)]]
    assert sched.block_manager.num_used_slots == 0


def test_request_level_baseline_feeds_longer_prompts_one_token_an_iteration():
    """ORCA §6.2: FasterTransformer's first iteration treats every prompt as the batch's shortest; the
    rest of a longer prompt goes in one token an iteration (samples dropped) before it generates."""
    sched = make("request", max_bs=2)
    sched.add(req(0, prompt_len=3, max_tokens=2))
    sched.add(req(1, prompt_len=6, max_tokens=2))
    seen, tokens = [], {"r0": [], "r1": []}
    while sched.has_work():
        plan = sched.schedule(0.0)
        seen.append([(s.request_id, s.start_pos, len(s.token_ids)) for s in plan.seqs])
        for e in sched.process_result(finish(plan), 0.0):
            tokens[e.request_id].append(e.token_id)
    assert seen == [[("r0", 0, 3), ("r1", 0, 3)],            # both as long as r0's 3 prompt tokens
                    [("r0", 3, 1), ("r1", 3, 1)],            # r0 generates, r1 feeds its 4th prompt token
                    [("r0", 4, 1), ("r1", 4, 1)],            # r0 done (now inactive), r1 feeds its 5th
                    [("r0", 4, 1), ("r1", 5, 1)],            # r1's last prompt token: its first sample
                    [("r0", 4, 1), ("r1", 6, 1)]]
    assert tokens == {"r0": [101, 102], "r1": [104, 105]}    # r1's samples of iterations 1-3 were dropped
    assert sched.block_manager.num_used_slots == 0


def test_unknown_policy_and_bad_results_are_errors():
    with pytest.raises(ValueError, match="scheduler.policy: expected one of orca"):
        make("lifo")
    sched = make()
    sched.add(req(0))
    plan = sched.schedule(0.0)
    with pytest.raises(ValueError, match="does not match"):
        sched.process_result(IterationResult(plan.iteration + 5, [1]), 0.0)
    with pytest.raises(ValueError, match="does not match"):   # a token per row of its plan, no more
        sched.process_result(IterationResult(plan.iteration, [1, 1]), 0.0)
    assert sched.expects(plan.iteration)   # a result that did not match leaves its iteration in flight


def test_token_budget_chunks_prompts_and_never_stalls_increments():
    """Sarathi-Serve's stall-free batching: increments take their token first, a long prompt is fed
    in chunks of what is left of max_num_batched_tokens, in order, once; its KV is reserved once."""
    sched = make(max_bs=4, **{"scheduler.max_num_batched_tokens": 8})
    sched.add(req(0, prompt_len=3, max_tokens=30))
    sched.add(req(1, prompt_len=2, max_tokens=30))
    run_steps = [sched.schedule(0.0)]
    sched.process_result(finish(run_steps[0]), 0.0)      # r0, r1 now increment
    sched.add(req(2, prompt_len=41, max_tokens=2))
    reserved = sched.block_manager.n_rsrv
    fed: list[tuple[int, int]] = []
    while sched.pool["r2"].output_token_ids == []:
        plan = sched.schedule(0.0)
        by_id = {s.request_id: s for s in plan.seqs}
        assert plan.num_tokens <= 8 and len(by_id["r0"].token_ids) == len(by_id["r1"].token_ids) == 1
        fed.append((by_id["r2"].start_pos, len(by_id["r2"].token_ids)))
        assert by_id["r0"].sample and by_id["r1"].sample and by_id["r2"].sample == (sum(n for _, n in fed) == 41)
        events = sched.process_result(finish(plan), 0.0)
        assert sched.block_manager.n_rsrv == reserved + 11                  # 41 + 2 tokens -> 11 blocks of 4
        assert ("r2" in {e.request_id for e in events}) == (sum(n for _, n in fed) == 41)  # no token before the prompt ends
    assert fed == [(0, 6), (6, 6), (12, 6), (18, 6), (24, 6), (30, 6), (36, 5)]
    events = run(sched)
    assert sum(e[0] == "r2" for e in events) == 1 and sched.block_manager.n_rsrv == 0


def test_token_budget_defers_a_prompt_that_gets_no_tokens():
    sched = make(max_bs=8, **{"scheduler.max_num_batched_tokens": 6})
    for i in range(3):
        sched.add(req(i, prompt_len=4, max_tokens=2))
    plan = sched.schedule(0.0)                            # r0 whole, r1 two tokens, r2 none: it waits
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in plan.seqs] == [("r0", 0, 4), ("r1", 0, 2)]
    assert not sched.pool["r2"].running
    events = run_from(sched, plan)
    assert sorted(e[0] for e in events) == ["r0", "r0", "r1", "r1", "r2", "r2"]


def test_a_short_prompt_behind_a_long_ones_prefill_is_fed_at_once():
    """Budget 16: a 6-token prompt arrives every iteration while r0's 64 are fed in chunks; each finishes
    within half of what the budget leaves, so it is fed whole at once before r0's chunk (before, r1
    waited out r0's last chunk), and r0 keeps the rest, at least half; once r0's rest fits, it is fed
    whole and the short one behind takes what is left. All end, the KV freed."""
    sched = make(max_bs=8, **{"scheduler.max_num_batched_tokens": 16})
    sched.add(req(0, prompt_len=64, max_tokens=2))
    sched.process_result(finish(sched.schedule(0.0)), 0.0)      # r0's first 16
    r0, fed = [], []
    for i in range(1, 6):
        sched.add(req(i, prompt_len=6, max_tokens=2))
        plan = sched.schedule(0.0)
        rows = {s.request_id: (s.start_pos, len(s.token_ids)) for s in plan.seqs}
        r0.append(rows["r0"][1])
        fed.append(rows[f"r{i}"])
        sched.process_result(finish(plan), 0.0)
    assert r0 == [10, 9, 9, 9, 11] and fed == [(0, 6)] * 4 + [(0, 4)]   # 15 left beside an increment: 6 and 9
    run(sched)
    assert not sched.pool and sched.block_manager.n_rsrv == 0


def test_only_short_prompts_right_behind_the_cut_one_go_first():
    """A prompt that fits is never cut for a later one (10 then 8 under 16: FCFS), and a short prompt behind
    a second long one waits with it: every prompt fed comes before every one that waits."""
    for lens, plan in (((10, 8), [("r0", 10), ("r1", 6)]), ((40, 40, 5), [("r0", 16)]),
                       ((40, 5, 40, 5), [("r0", 11), ("r1", 5)])):
        sched = make(max_bs=8, **{"scheduler.max_num_batched_tokens": 16})
        for i, n in enumerate(lens):
            sched.add(req(i, prompt_len=n, max_tokens=2))
        assert [(s.request_id, len(s.token_ids)) for s in sched.schedule(0.0).seqs] == plan, lens


def test_request_level_baseline_ignores_the_token_budget():
    sched = make("request", max_bs=4, **{"scheduler.max_num_batched_tokens": 2})
    sched.add(req(0, prompt_len=5))
    sched.add(req(1, prompt_len=5))
    assert sched.schedule(0.0).num_tokens == 10


def test_request_level_a_member_failing_before_its_first_token_leaves_its_batch():
    """It used to stay in the batch as an inactive member and be planned again from an empty
    output (IndexError): the scheduler process died and every request got `unavailable`."""
    sched = make("request", max_bs=2)
    sched.add(req(0, max_tokens=3))
    sched.add(req(1, max_tokens=3))
    events = run(sched, fail=frozenset({"r0"}))
    assert [(rid, reason) for rid, _, reason in events if reason] == [("r0", "error"), ("r1", "length")]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks and sched.block_manager.n_rsrv == 0


def test_request_level_aborting_the_last_unfinished_member_ends_the_batch():
    """A member aborted between its iterations, with nobody else in its batch left to run, used to
    leave a batch of finished requests that never ended: `select` returned [] and the next request starved."""
    sched = make("request", max_bs=1)
    sched.add(req(0, max_tokens=5))
    sched.process_result(finish(sched.schedule(0.0)), 0.0)    # r0 has a token and waits for its next iteration
    assert [(e.request_id, e.finish_reason) for e in sched.abort("r0")] == [("r0", None), ("r0", "abort")]  # held till now
    sched.add(req(1, max_tokens=2))
    assert [(rid, reason) for rid, _, reason in run(sched) if reason] == [("r1", "length")]


def test_one_clients_many_choices_leave_room_for_another_clients_request():
    """Issue 44: 16 choices of one client with no max_tokens each reserve the rest of the context (2048
    slots of a 16,384-slot pool), then another client sends 4 tokens. Before, its request waited behind
    the choices that did not fit (FCFS) until the first ones finished; now the first client's
    reservations stop short of the pool's headroom, the other's request starts in the next iteration
    and finishes in its own four, and the choices each get a turn in arrival order, none deadlocked."""
    sched = make(max_bs=32, **{"engine.n_slots": 16384, "engine.block_size": 16})
    for i in range(16):
        sched.add(Request(f"a{i}", [7] * 30, SamplingParams(max_tokens=2018, ignore_eos=True), client="a"))
    plan = sched.schedule(0.0)
    started = [s.request_id for s in plan.seqs]
    assert started == [f"a{i}" for i in range(7)]   # 7 x 128 blocks: the 8th would take the headroom (64 of 1024)
    sched.add(Request("b0", [5] * 10, SamplingParams(max_tokens=4, ignore_eos=True), client="b"))
    events = [(e.request_id, e.finish_reason) for e in sched.process_result(finish(plan), 0.0)]
    plans = []
    for _ in range(4):
        plans.append(plan := sched.schedule(0.0))
        events += [(e.request_id, e.finish_reason) for e in sched.process_result(finish(plan), 0.0)]
    assert "b0" in [s.request_id for s in plans[0].seqs] and ("b0", "length") in events
    assert sched.block_manager.n_rsrv <= sched.block_manager.num_blocks


def test_a_client_is_fcfs_and_round_robin_with_others():
    """Each client's requests in arrival order, clients taking turns; a request past its client's
    share waits without letting that client's later ones pass it, other clients go on."""
    sched = make(max_bs=4, **{"engine.n_slots": 256, "server.client_headroom": 0.25})   # 64 blocks, 16 kept
    for i in range(3):
        sched.add(Request(f"a{i}", [7] * 60, SamplingParams(max_tokens=40, ignore_eos=True), client="a"))   # 25 blocks
    sched.add(Request("a3", [7] * 2, SamplingParams(max_tokens=2, ignore_eos=True), client="a"))
    sched.add(Request("b0", [7] * 2, SamplingParams(max_tokens=2, ignore_eos=True), client="b"))
    plan = sched.schedule(0.0)
    # a0 (25), b0 (1) take turns; a1 would leave 13 < 16 free past a's share (64 // 3): it waits, and a3 behind it
    assert [s.request_id for s in plan.seqs] == ["a0", "b0"]
    events = run_from(sched, plan)
    assert sorted(rid for rid, _, reason in events if reason) == ["a0", "a1", "a2", "a3", "b0"]


def test_select_shortcut_is_reserve_in_order():
    """With every request idle and started, select takes the interleaved pool's first max_bs without the
    per-request pass: what reserve_in_order gives then. Client a's requests start first; each of b's, arriving
    later, takes a place ahead of a's later ones (round robin), so more requests are started than max_bs."""
    sched = make(max_bs=4)
    assert isinstance(sched, OrcaScheduler)
    for j in range(4):
        sched.add(Request(f"a{j}", [7] * 5, SamplingParams(max_tokens=40, ignore_eos=True), arrival=float(j), client="a"))
    results, shortcuts = [], 0
    for i in range(60):
        if i % 6 == 1:
            sched.add(Request(f"b{i}", [7] * 5, SamplingParams(max_tokens=3 + i % 5, ignore_eos=True), arrival=10.0 + i, client="b"))
        for r in results:
            sched.apply(r, 0.0)
        if not sched.in_flight and not sched.unstarted:
            shortcut = sched.select(0.0)
            assert shortcut == sched.reserve_in_order(sched.order[1], strict=True)
            shortcuts += len(sched.pool) > sched.max_bs
        out = sched.step(0.0, [])
        results = [finish(p) for p in out.plans]
    assert shortcuts >= 5


def test_a_clients_rows_wait_while_another_client_has_some():
    """scheduler.client_rows = 2: while b's request runs, a's six keep two places an iteration, its first
    in the batch's order (ORCA's: its earliest), b's every iteration; then, alone, a's all run together.
    Every request ends with all its tokens, and the rows held are counted."""
    sched = make(max_bs=32, **{"scheduler.client_rows": 2})
    for i in range(6):
        sched.add(Request(f"a{i}", [7] * 5, SamplingParams(max_tokens=12, ignore_eos=True), arrival=float(i), client="a"))
    sched.add(Request("b0", [5] * 5, SamplingParams(max_tokens=4, ignore_eos=True), arrival=6.0, client="b"))
    batches, events = [], []
    while sched.has_work():
        plan = sched.schedule(0.0)
        batches.append([s.request_id for s in plan.seqs])
        events += [(e.request_id, e.finish_reason) for e in sched.process_result(finish(plan), 0.0)]
    assert [set(b) for b in batches[:4]] == [{"a0", "a1", "b0"}] * 4
    # b0 ended in its fourth: a's all run, a0 and a1 (four tokens ahead) end four iterations before the rest
    assert batches[4:] == [[f"a{i}" for i in range(6)]] * 8 + [["a2", "a3", "a4", "a5"]] * 4
    assert sorted(rid for rid, reason in events if reason == "length") == sorted([f"a{i}" for i in range(6)] + ["b0"])
    assert sched.block_manager.n_rsrv == 0
    samples = {s.name: s.value for m in EngineCollector("m", {"scheduler": sched.stats()}).collect() for s in m.samples}
    assert samples["orca_mq:client_turn_waits_total"] == 4 * 4   # a's four others, each of b's four iterations


def test_client_rows_count_another_clients_rows_in_flight():
    """Two pipeline stages: b's row is in the other stage's iteration while the next one is planned, and
    still holds a to two rows in every iteration until b0 ends."""
    sched = make(max_bs=32, **{"scheduler.client_rows": 2, "engine.n_workers": 2})
    for i in range(6):
        sched.add(Request(f"a{i}", [7] * 5, SamplingParams(max_tokens=12, ignore_eos=True), arrival=float(i), client="a"))
    sched.add(Request("b0", [5] * 5, SamplingParams(max_tokens=8, ignore_eos=True), arrival=6.0, client="b"))
    results, finals, plans = [], set(), []
    while sched.has_work():
        out = sched.step(0.0, results)
        finals |= {e.request_id for e in out.events if e.finish_reason}
        plans += [([s.request_id for s in p.seqs], "b0" in finals) for p in out.plans]
        results = [finish(p) for p in out.plans]
    before = [ids for ids, b_ended in plans if not b_ended]
    assert len(before) > 8 and all(sum(r.startswith("a") for r in ids) <= 2 for ids in before)
    assert len(finals) == 7


def test_client_rows_leave_one_client_equal_clients_and_the_request_level_batch_whole():
    """A client is held only past both the cap and the next largest client's count: one client alone, two
    of equal counts (one user's parallel connections) and the request-level baseline's batch run whole; of
    five and three, the five keep three."""
    for policy, clients, first in (("orca", "aaaa", 4), ("orca", "aabb", 4), ("request", "abab", 4), ("orca", "aaaaabbb", 6)):
        sched = make(policy, max_bs=32, **{"scheduler.client_rows": 1})
        for i, c in enumerate(clients):
            sched.add(Request(f"{c}{i}", [7] * 5, SamplingParams(max_tokens=3, ignore_eos=True), arrival=float(i), client=c))
        assert len(sched.schedule(0.0).seqs) == first


def test_client_rows_default_caps_clients_on_a_cpu_only():
    """scheduler.client_rows' default (-1, auto): a cap of two rows where the engine computes on a CPU, none on
    CUDA (decided from engine.device alone; nothing runs); a number given is kept."""
    assert make().client_rows == 2
    assert make(**{"engine.device": "cuda"}).client_rows == 0
    assert make(**{"engine.device": "cuda", "scheduler.client_rows": 3}).client_rows == 3
    assert make(**{"scheduler.client_rows": 0}).client_rows == 0
    assert make("request").client_rows == 0


def test_a_started_request_behind_one_that_cannot_start_still_runs():
    """x1 (10 of 16 blocks) fits the pool but not its client's share, so y1 (8) starts beside x0 and y0; when
    x0 and y0 end, the clients' turns put x1 first, and x1 cannot fit beside y1's reservation. FCFS keeps
    every later request from starting, but y1 has started: it must still run (before, the pass stopped at
    x1, nothing ran and nothing was in flight: a deadlock), and x1 starts once y1 has ended."""
    sched = make(max_bs=8, **{"engine.n_slots": 64})   # 16 blocks of 4; the default headroom keeps 1
    for rid, client, prompt, max_tokens in (("x0", "x", 18, 2), ("y0", "y", 2, 2), ("x1", "x", 38, 2), ("y1", "y", 2, 30)):
        sched.add(Request(rid, [7] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), client=client))
    plan = sched.schedule(0.0)
    assert [s.request_id for s in plan.seqs] == ["x0", "y0", "y1"]
    events = run_from(sched, plan)
    assert [rid for rid, _, reason in events if reason] == ["x0", "y0", "y1", "x1"]
