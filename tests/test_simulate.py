"""orca_mq/bench/simulate.py (tools/simulate.py): the real schedulers on a virtual clock, against hand-computed JCTs."""
from __future__ import annotations

from orca_mq import SamplingParams
from orca_mq.bench.simulate import profile_cost, replay_scorecard, simulate
from orca_mq.config import Config
from orca_mq.models.info import ModelInfo
from orca_mq.sched.orca import OrcaScheduler
from orca_mq.sched.profiler import IterationProfile
from orca_mq.sched.request import Request
from orca_mq.sched.srpt import SrptOracle

INFO = ModelInfo("fake", "llama", 64, 16, 2, 4, 2, 128, 1e-5, 4096, eos_token_ids=[2])
ONE_SECOND = IterationProfile([(1, 1.0), (100, 1.0)], [(1, 1.0), (64, 1.0)])   # every iteration takes 1 s


def _requests() -> list[Request]:
    # A (3 tokens) arrives just before B (1 token); one request per iteration
    return [Request("A", [5] * 5, SamplingParams(max_tokens=3, ignore_eos=True), 0.0),
            Request("B", [5] * 5, SamplingParams(max_tokens=1, ignore_eos=True), 0.0)]


def _cfg() -> Config:
    cfg = Config()
    cfg.set("scheduler.max_bs", 1)
    return cfg


def test_orca_runs_fcfs_on_the_virtual_clock():
    # A: t = 1, 2, 3 (done at 3); B waits for A's reservation order: done at 4
    result = simulate(OrcaScheduler(_cfg(), INFO), _requests(), profile_cost(ONE_SECOND))
    assert result["jct_mean_s"] == 3.5 and result["makespan_s"] == 4.0


def test_srpt_oracle_runs_the_shortest_first():
    # B (1 token left) before A: B done at 1, A at 4
    oracle = SrptOracle(_cfg(), INFO)
    oracle.use_profile(ONE_SECOND)
    result = simulate(oracle, _requests(), profile_cost(ONE_SECOND))
    assert result["jct_mean_s"] == 2.5 and result["makespan_s"] == 4.0


def test_a_scorecard_is_replayed_on_its_own_traces(tmp_path):
    # one round of the FastServe trace at load 1 of 2 req/s for 10 s: 20 requests, seed 0 + 1 + round
    from orca_mq.config import load_config

    runs = [{"trace": "fastserve", "load": 1.0, "round": 0, "policy": pol, "summary": {"jct_mean_s": jct}}
            for pol, jct in (("orca", 2.0), ("fastserve", 2.2), ("orca-again", 1.8))]
    card = {"args": {"duration": 10.0, "min_requests": 20, "max_requests": 80, "seed": 0},
            "capacity": {"fastserve": 2.0}, "runs": runs}
    path = tmp_path / "card.json"
    path.write_text(__import__("json").dumps(card))
    row, = replay_scorecard(str(path), load_config(None, []), IterationProfile([(1, 0.03), (512, 0.9)], [(1, 0.03), (32, 0.1)]))
    assert row["n"] == 20 and row["served"] == {"orca": 1.0, "fastserve": 1.1, "orca-again": 0.9}
    assert row["sim"]["orca"] == 1.0 and set(row["sim"]) == {"orca", "fastserve"}    # the A/A pair is the served machine's
    assert 0.5 < row["sim"]["fastserve"] < 1.5 and row["sim_jct_mean_s"]["orca"] > 0
