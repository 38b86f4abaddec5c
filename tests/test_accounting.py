"""bench_iteration's ledger (orca_mq/bench/accounting.py) times every seam of an iteration: each
GEMM, attention, the layer ops, sampling and the plan's tensors are seen, and they never add up to
more than the iteration."""
from __future__ import annotations

import time

from orca_mq.bench.accounting import CATEGORIES, instrument
from orca_mq.config import load_config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.protocol.iteration import IterationPlan, SeqWork


def test_every_seam_of_an_iteration_is_timed(tiny_llama_dir) -> None:
    runner = ModelRunner(load_config(overrides={"model.path": str(tiny_llama_dir), "engine.block_size": 8,
                                                "engine.n_slots": 256, "model.dtype": "float32"}))
    plan = IterationPlan(0, [SeqWork("a", list(range(3, 20)), 0, [0, 1, 2]), SeqWork("b", [5, 6, 7], 0, [3])])
    with instrument(runner) as ledger:
        t = time.perf_counter()
        runner.execute(plan)
        wall = time.perf_counter() - t
        seen = ledger.reset()
    assert set(seen) == set(CATEGORIES)
    # the model calls a bound partial of gemm.linear: patching the gemm module saw no GEMM at all
    assert seen["GEMMs (layers)"] > 0 and seen["GEMM (LM head)"] > 0
    assert all(seen[k] > 0 for k in CATEGORIES[2:8]), seen
    assert sum(seen.values()) <= wall
