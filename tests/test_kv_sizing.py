"""The KV pool sized from the device's memory (issue 42, item 1): its arithmetic; the profile's
readings put in their terms (a scripted device memory in this process); and through real
processes, two pipeline stages whose devices leave different room: the smallest figure reaches
every worker, the scheduler and the frontend, and a pool too small for one request is refused
at start in one line. The CPU without a device memory keeps its configured pool."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_mq.client import Client
from orca_mq.config import load_config
from orca_mq.engine.kv_budget import profile_rows
from orca_mq.kv.pool import AUTO_CPU_SLOTS, PoolSize
from orca_mq.kv.sizing import FAKE_ENV, KVSizing, check_fits
from tests.serving_harness import start_server

LAYER_BLOCK = 2 * 16 * 2 * 16 * 4   # tiny_served_dir: K and V of one layer, a block of 16, 2 KV heads of 16, fp32


@given(total=st.integers(1 << 20, 1 << 40), util=st.floats(0.05, 1.0), weights=st.integers(0, 1 << 36),
       other=st.integers(0, 1 << 34), activations=st.integers(0, 1 << 34), graphs=st.integers(0, 1 << 32),
       block_bytes=st.integers(1, 1 << 24), block_size=st.sampled_from([1, 16, 32]))
@settings(max_examples=200, deadline=None)
def test_the_terms_leave_whole_blocks_and_the_scratch_block(total: int, util: float, weights: int, other: int,
                                                            activations: int, graphs: int, block_bytes: int,
                                                            block_size: int) -> None:
    s = KVSizing(total, util, weights, other, activations, graphs, block_bytes, block_size)
    assert s.kv_bytes == int(util * total) - weights - other - activations - graphs
    if s.kv_bytes >= 2 * block_bytes:   # the pool and its scratch block fit, one more block would not
        assert (s.blocks + 1) * block_bytes <= s.kv_bytes < (s.blocks + 2) * block_bytes
    else:
        assert s.blocks == 0


@given(budget=st.integers(0, 4096), max_bs=st.integers(1, 512), max_len=st.integers(2, 8192))
def test_the_profiled_iteration_carries_the_most_tokens_an_iteration_can(budget: int, max_bs: int, max_len: int) -> None:
    """The token budget, or max_bs decode rows' tokens where that is more (each takes its token past a
    smaller budget), or a whole context; at most max_bs rows unless the context is shorter, none too long."""
    rows = profile_rows(budget, max_bs, max_len)
    tokens = max(budget, max_bs) if budget else max_len - 1
    assert sum(rows) == tokens and all(1 <= n <= max_len - 1 for n in rows)
    assert len(rows) <= max_bs or len(rows) == -(-tokens // (max_len - 1))


def test_each_term_is_said_and_a_pool_short_of_one_request_is_refused_in_one_line() -> None:
    gib = 1 << 30
    s = KVSizing(80 * gib, 0.9, 16 * gib, gib // 2, 3 * gib, gib, 2 << 20, 16)
    s = dataclasses.replace(s, agreed=s.blocks)
    line = s.describe()
    for term in ("0.9 x 80.00 GiB", "weights and buffers 16.00", "other 0.50", "activations 3.00", "CUDA graphs 1.00",
                 "= 51.50 GiB of KV at 128.0 KiB a slot", f"{s.blocks * 16} slots"):
        assert term in line, line
    assert s.as_dict()["slots"] == s.blocks * 16 and s.as_dict()["kv_bytes"] == s.kv_bytes
    check_fits(s, s.blocks * 16)   # exactly one request of the whole context fits
    with pytest.raises(ValueError) as e:
        check_fits(s, s.blocks * 16 + 1)
    assert "model.max_model_len" in str(e.value) and "\n" not in str(e.value)


@dataclass
class Scripted:
    """A device memory read in the order a profile reads it (orca_mq/engine/kv_budget.py): the
    forward peaks `activations` above where it started; the allocator holds `graphs` more after the
    capture than before it, and `held` once both are dropped."""

    total: int
    free: int
    activations: int
    graphs: int
    held: int
    reserved_reads: list[int] = field(default_factory=list)

    def info(self) -> tuple[int, int]:
        return self.free, self.total

    def allocated(self) -> int:
        return 7_000

    def peak(self) -> int:
        return 7_000 + self.activations

    def reserved(self) -> int:
        self.reserved_reads.append(len(self.reserved_reads))
        return [50_000, 50_000 + self.graphs, self.held][len(self.reserved_reads) - 1]

    def reset_peak(self) -> None:
        pass

    def release(self) -> None:
        pass


def test_the_profile_puts_each_reading_in_its_term_and_the_agreed_pool_is_allocated(tiny_served_dir: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from orca_mq.engine import model_runner

    cfg = load_config(overrides={"model.path": str(tiny_served_dir), "model.dtype": "float32", "engine.device": "cpu",
                                 "engine.cuda_graphs": "on", "scheduler.max_bs": 4, "model.max_model_len": 128})
    mem = Scripted(total=10 << 20, free=6 << 20, activations=300_000, graphs=200_000, held=3 << 20)
    monkeypatch.setattr(model_runner, "memory_source", lambda *_: mem)
    seen: list[int] = []
    runner = model_runner.ModelRunner(cfg, agree=lambda n: seen.append(n) or n // 2)   # the other stage had half
    s = runner.kv_sizing
    assert s is not None and len(mem.reserved_reads) == 3
    assert (s.total, s.weights, s.other, s.activations, s.graphs) == (10 << 20, 3 << 20, 1 << 20, 300_000, 200_000)
    block_bytes = 2 * LAYER_BLOCK   # both layers on one stage
    assert s.block_bytes == block_bytes and seen == [s.blocks] and s.agreed == s.blocks // 2
    assert s.blocks == (int(0.9 * (10 << 20)) - (3 << 20) - (1 << 20) - 500_000) // block_bytes - 1
    assert runner.pool.device_blocks == s.agreed and runner.kv.num_blocks == s.agreed + 1
    assert runner.graphs is not None and runner.geometry.num_blocks == s.agreed
    mem.reserved_reads.clear()
    with pytest.raises(ValueError, match="less than one model.max_model_len = 128 request"):
        model_runner.ModelRunner(cfg, agree=lambda n: 128 // 16 - 1)


def test_the_cpu_keeps_its_configured_pool_and_an_untold_process_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAKE_ENV, raising=False)
    cfg = load_config(overrides={"engine.device": "cpu"})
    assert cfg.engine.n_slots == 0 and PoolSize.from_config(cfg).device_slots == AUTO_CPU_SLOTS == 16384
    cfg.engine.n_slots = 4096
    assert PoolSize.from_config(cfg).device_slots == 4096
    cfg.engine.n_slots = 0
    monkeypatch.setenv(FAKE_ENV, "1000000:0")
    with pytest.raises(ValueError, match="started without their figure"):
        PoolSize.from_config(cfg)


def _used(total: int, blocks: int, layers: int = 1) -> int:
    """What others hold of a fake device of `total` bytes for a stage of `layers` to be left `blocks` blocks."""
    return int(0.9 * total) - (blocks + 1) * layers * LAYER_BLOCK


def test_the_smallest_stage_figure_reaches_every_process(tmp_path: Path, tiny_served_dir: Path) -> None:
    total = 1_000_000
    env = {FAKE_ENV: f"{total}:{_used(total, 100)},{_used(total, 40)}"}
    server = start_server(tmp_path, n_workers=2, env=env, **{"model.path": tiny_served_dir})
    try:
        with Client(server.address) as c:
            out = c.generate("hello there", max_tokens=5, temperature=0.0, ignore_eos=True)
            stats = c.stats()
        assert len(out.token_ids) == 5
        pools = {w["stage"]: w["kv_pool"] for w in stats["workers"]}
        assert pools[0]["blocks"] == 100 and pools[1]["blocks"] == 40, pools
        assert pools[0]["agreed"] == pools[1]["agreed"] == 40 and pools[0]["other"] == _used(total, 100)
        assert stats["scheduler"]["n_slots"] == stats["frontend"]["kv_slots"] == 40 * 16
        err = server.stderr()
        assert "worker0: KV pool from the device's memory" in err and "1600 slots (every stage: 640)" in err, err
        assert "worker1: KV pool from the device's memory" in err and "640 slots" in err
    finally:
        server.stop()


def test_a_pool_short_of_one_request_is_refused_at_start_in_one_line(tmp_path: Path, tiny_served_dir: Path) -> None:
    total = 1_000_000
    with pytest.raises(RuntimeError) as e:   # 10 blocks: 160 slots for a 256-token context
        start_server(tmp_path, env={FAKE_ENV: f"{total}:{_used(total, 10, layers=2)}"}, ready_timeout=120,
                     **{"model.path": tiny_served_dir})
    lines = [line for line in str(e.value).splitlines() if line.startswith("orca-mq") and "error" in line]
    assert len(lines) == 1 and "holds 160 slots, less than one model.max_model_len = 256 request" in lines[0], str(e.value)
