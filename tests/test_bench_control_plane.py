"""The control-plane benchmark (tools/bench_control_plane.py) and the replay over several client
processes it shares with tools/bench.py: shares of a trace, CPU read from /proc, and one tiny round
end to end (offline engine, real server, two client processes)."""
from __future__ import annotations

import os
import time

import pytest

from orca_mq.bench.client_procs import shares
from orca_mq.bench.control_plane import SERVING, Setup, run, table, targets
from orca_mq.bench.timing import CpuTime, cpu_seconds, cpu_time
from orca_mq.bench.trace import TraceSpec, make_chat_trace, make_trace

CORPUS = list(range(1000, 6000))


def test_shares_split_requests_round_robin_and_keep_conversations_whole():
    trace = make_trace(TraceSpec(num_requests=10, rate=0.0, input_len=(4, 8), output_len=(2, 4)), CORPUS)
    parts = shares(trace, 3)
    assert [[r.index for r in p] for p in parts] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    chat = make_chat_trace(TraceSpec(kind="multiturn", num_requests=4, rate=0.0, input_len=(4, 8), output_len=(2, 4),
                                     system_prompts=0, turns=3), CORPUS, lambda ids: " ".join(map(str, ids)))
    for part in shares(chat, 3):
        conversations = {t.conversation for t in part}
        assert all(sum(t.conversation == c for t in part) == 3 for c in conversations)   # all turns of each


def test_cpu_seconds_follow_the_process():
    before, fine = cpu_seconds(os.getpid()), cpu_time(os.getpid())
    start = time.process_time()
    while time.process_time() < start + 0.3:
        pass
    spent = time.process_time() - start
    assert 0.2 <= cpu_seconds(os.getpid()) - before <= 1.0
    assert fine.threads, "no per-thread run time in /proc: the control-plane bench would count ticks"
    assert abs((cpu_time(os.getpid()) - fine) - spent) < 0.02   # nanoseconds, not 10 ms ticks


def test_cpu_time_falls_back_to_ticks_when_a_thread_ended():
    before = cpu_time(os.getpid())
    gone = CpuTime(before.ticks, {**before.threads, "0": 10**12})   # with a thread that no longer runs
    after = cpu_time(os.getpid())
    assert after - gone == after.ticks - before.ticks and after - before != after.ticks - before.ticks


def test_one_tiny_round_end_to_end(tmp_path):
    setup = Setup(requests=8, input_len=(8, 16), output_len=(6, 6), max_bs=8, budget=64, layers=1, client_procs=2)
    result = run(setup, 1, tmp_path)
    (r,) = result["rounds"]
    assert r["offline"]["tokens"] == r["served"]["tokens"] == 8 * 6
    assert r["ratio"] == r["served"]["tokens_per_s"] / r["offline"]["tokens_per_s"] > 0
    us = r["served"]["us_per_token"]
    assert set(us) == {*SERVING, "worker", "clients"} and us["clients"] > 0
    assert result["median"]["us_per_token"] == us and 0 < result["emit_us_per_token"] < 100
    assert 0 < result["rows_us_per_token"] < 100
    parts = r["served"]["scheduler_us_per_token"]   # the scheduler's stats: its main thread's CPU by part
    assert parts["step"] > 0 and parts["decode"] > 0 and parts["token_frames"] > 0 and parts["loop"] > 0
    assert sum(parts[p] for p in ("decode", "step", "plan_frames", "token_frames", "loop")) == pytest.approx(parts["main"])
    assert parts["main"] <= us["scheduler"] * 1.05   # the main thread is part of the process (its clock reads apart)
    text = table(result)
    assert "median" in text and "by part" in text


def test_scheduler_burst_by_part():
    """tools/bench_scheduler.py --burst's library: every token of the burst counted, every part timed,
    the caches streamed between iterations when asked (a small burst: prompts chunked by the budget, stops
    by length)."""
    from orca_mq.bench.sched_burst import PARTS, burst
    from orca_mq.models.info import ModelInfo

    info = ModelInfo(path="b", arch="llama", vocab_size=1000, hidden_size=8, n_layers=2, n_heads=2, n_kv_heads=1,
                     intermediate_size=16, norm_eps=1e-5, context_length=1024, eos_token_ids=[2])
    for evict_mb in (0, 1):
        r = burst(info, requests=12, max_bs=8, budget=64, input_len=(8, 40), output_len=5, evict_mb=evict_mb, seed=1)
        assert r["tokens"] == 12 * 5 and r["iterations"] >= 5 * 12 // 8
        assert set(r["us_per_token"]) == set(PARTS) and all(v > 0 for v in r["us_per_token"].values())


def test_the_kv_room_holds_max_bs_requests_beside_the_fair_shares_headroom(tmp_path):
    """Every request of a burst of max_bs at their longest runs in one batch (with room for exactly max_bs,
    the headroom one client may not reserve kept the last 1/16 waiting for the others to end)."""
    from orca_mq import LLM, SamplingParams
    from orca_mq.bench.random_models import random_llama

    setup = Setup(requests=16, input_len=(4, 4), output_len=(8, 8), max_bs=16, budget=256, layers=1)
    llm = LLM(model=str(random_llama(tmp_path / "m", layers=1, max_positions=setup.max_len)),
              **{k.replace(".", "__"): v for k, v in setup.config().items()})
    rows, step = [], llm.scheduler.step

    def counted(*args):
        out = step(*args)
        rows.extend(p.num_rows for p in out.plans)
        return out

    llm.scheduler.step = counted
    llm.generate([[504 + i] * 4 for i in range(16)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert rows[-8:] == [16] * 8


def test_issue_42s_targets_are_judged_only_at_batch_256():
    us = {"broker": 4.0, "frontend": 6.0, "scheduler": 4.9}
    steady = Setup(max_bs=256)
    assert targets(steady, {"ratio": 1.0, "tokens_per_iteration": 250.0, "us_per_token": us})["batch_256"]["met"]
    assert not targets(steady, {"ratio": 1.0, "tokens_per_iteration": 250.0, "us_per_token": us | {"scheduler": 5.1}})["batch_256"]["met"]
    assert not targets(steady, {"ratio": 0.94, "tokens_per_iteration": 250.0, "us_per_token": us})["batch_256"]["met"]
    assert targets(steady, {"ratio": 1.0, "tokens_per_iteration": 229.0, "us_per_token": us})["batch_256"] is None
    assert targets(Setup(max_bs=128), {"ratio": 1.0, "tokens_per_iteration": 128.0, "us_per_token": us})["batch_256"] is None
