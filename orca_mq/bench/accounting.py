"""Where an engine iteration's time goes: wall-clock timers on the model's seams (tools/bench_iteration.py).

Every GEMM goes through the model's `linear` (engine.gemm.linear with its row cut), attention through the backend's `write_kv` / `attend`,
norms (with the residual adds they carry), rotary and the MLP's activation through the backend's layer
ops (`engine/layer_ops.py`), sampling through `sample`, the plan's tensors through `pack`, `build`, the stager and `metadata`
(orca_mq/engine/step_inputs.py). A
`Ledger` wraps each seam of one runner with a timer (on the CPU every op is synchronous, so a call's
wall time is its cost) and adds it to its category; what no seam covers (views, the embedding, the
Python between ops) is the iteration's time without the timers minus the categories.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from orca_mq.engine import model_runner
from orca_mq.models.layers.mlp import DenseMLP
from orca_mq.engine.model_runner import ModelRunner

CATEGORIES = ("GEMMs (layers)", "GEMM (LM head)", "attention (KV write + attend)", "norms + residual adds",
              "rotary", "activation (SiLU x up)", "sampling", "plan -> tensors")


@dataclass(slots=True)
class Ledger:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))

    def timer(self, category: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = category(*args, **kwargs) if callable(category) else category
                self.seconds[key] += time.perf_counter() - t
        return timed

    def reset(self) -> dict[str, float]:
        out, self.seconds = self.seconds, dict.fromkeys(CATEGORIES, 0.0)
        return out


class _Timed:
    """An object whose named methods are timed (backends and layer ops are slotted: no patching)."""

    def __init__(self, inner: Any, ledger: Ledger, methods: dict[str, str]) -> None:
        self.inner = inner
        for name, category in methods.items():
            setattr(self, name, ledger.timer(category, getattr(inner, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def instrument(runner: ModelRunner) -> Iterator[Ledger]:
    """Timers on `runner`'s seams for the duration of the block."""
    ledger = Ledger()
    m = runner.model
    head = m.w.lm_head

    def gemm_kind(x: Any, w: Any, b: Any = None, **_: Any) -> str:
        return CATEGORIES[1] if w is head else CATEGORIES[0]

    patches = [(m, "linear", ledger.timer(gemm_kind, m.linear)),   # a bound partial: patching the module misses it
               (model_runner, "sample", ledger.timer(CATEGORIES[6], model_runner.sample)),
               *((obj, name, ledger.timer(CATEGORIES[7], getattr(obj, name)))   # columns, host arrays, the copy, views
                 for obj, name in ((model_runner, "pack"), (model_runner, "build"), (runner.stager, "stage"),
                                   (model_runner, "metadata"))),
               (m, "attention", _Timed(m.attention, ledger, {"write_kv": CATEGORIES[2], "attend": CATEGORIES[2]})),
               (m, "ops", _Timed(m.ops, ledger, {"rms_norm": CATEGORIES[3], "add_rms_norm": CATEGORIES[3],
                                                 "rotary": CATEGORIES[4], "silu_mul": CATEGORIES[5]})),
               # a dense MLP holds its GEMM and activation from construction: time them where it holds them
               *((mlp, name, timer) for mlp in m.mlps if isinstance(mlp, DenseMLP)
                 for name, timer in (("linear", ledger.timer(gemm_kind, mlp.linear)),
                                     ("act", ledger.timer(CATEGORIES[5], mlp.act))))]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield ledger
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
