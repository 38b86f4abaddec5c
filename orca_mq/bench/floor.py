"""A machine's compute floor for one model: GEMM rates at the model's own shapes, memory read
bandwidth, and the floor of a trace (tools/bench_floor.py prints them; BENCHMARKS.md keeps them).

The floor of a trace counts only the GEMMs its tokens need: every prompt token once through the
layers at the chunk rate (an iteration of `token budget` rows), every generated token but the last
once through the layers at the decode rate (`max_bs` rows), and the LM head once per generated
token (the logits it is sampled from) at the decode rate. Attention, norms, sampling and all
serving overheads are what a served run adds on top.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from orca_mq.bench.timing import interleaved_medians
from orca_mq.engine import gemm
from orca_mq.models.weights import MATRICES, StageWeights

Tensor = torch.Tensor


@dataclass(slots=True)
class GemmRates:
    """Seconds for all layers' GEMMs and for the LM head at M rows, by method."""

    layer_params: int                       # weights multiplied per token by the stage's layers
    head_params: int
    layers: dict[int, dict[str, float]] = field(default_factory=dict)   # M -> method -> s
    head: dict[int, dict[str, float]] = field(default_factory=dict)

    def best_layers(self, m: int) -> float:
        return min(self.layers[m].values())

    def best_head(self, m: int) -> float:
        return min(self.head[m].values())

    def gflops(self, m: int, seconds: float, params: int) -> float:
        return 2 * m * params / seconds / 1e9


def _products(w: StageWeights) -> tuple[list[Tensor], Tensor]:
    assert w.lm_head is not None, "the floor needs a stage with the LM head (one stage)"
    return [layer[k] for layer in w.layers for k in MATRICES if k in layer], w.lm_head


def measure_gemms(weights: StageWeights, methods: Sequence[gemm.Method], rows: Sequence[int],
                  repeat: int) -> GemmRates:
    """Every layer's products over the stage's own weights (so they stream from memory as in an
    iteration, not from cache) and the LM head, at each M in `rows`, each method interleaved."""
    mats, head = _products(weights)
    rates = GemmRates(sum(m.numel() for m in mats), head.numel())
    prepared = {meth: ([gemm.prepare(m, meth) for m in mats], gemm.prepare(head, meth)) for meth in methods}
    dtype = head.dtype
    for m in rows:
        xs = {k: torch.randn(m, k, dtype=dtype) for k in {w.shape[1] for w in mats}}
        xh = torch.randn(m, head.shape[1], dtype=dtype)

        def layers(ws: list[Tensor]) -> Callable[[], object]:
            return lambda: [gemm.linear(xs[w.shape[1]], w) for w in ws]

        fns = [layers(prepared[meth][0]) for meth in methods]
        fns += [(lambda h=prepared[meth][1]: gemm.linear(xh, h)) for meth in methods]
        times = interleaved_medians(fns, repeat)
        rates.layers[m] = dict(zip(methods, times[: len(methods)]))
        rates.head[m] = dict(zip(methods, times[len(methods):]))
    return rates


def read_bandwidth(repeat: int, mib: int = 512) -> float:
    """Bytes per second a sum over a buffer far larger than the caches reads, on this thread's team."""
    buf = torch.ones(mib << 18, dtype=torch.float32)
    return buf.numel() * 4 / interleaved_medians([buf.sum], repeat)[0]


def weight_bytes(weights: StageWeights) -> tuple[int, int]:
    """Bytes an iteration reads from the layers' matrices and from the LM head."""
    mats, head = _products(weights)
    return sum(m.numel() * m.element_size() for m in mats), head.numel() * head.element_size()


@dataclass(slots=True)
class TraceFloor:
    prompt_tokens: int
    generated_tokens: int
    layer_rows_prompt: int      # rows through the layers at the chunk rate
    layer_rows_decode: int      # ... at the decode rate
    head_rows: int
    prompt_s: float
    decode_s: float
    head_s: float
    min_iterations: int         # sequential iterations no schedule can avoid
    read_once_s: float

    @property
    def gemm_s(self) -> float:
        return self.prompt_s + self.decode_s + self.head_s

    @property
    def bandwidth_s(self) -> float:
        """Each of the unavoidable iterations reads every weight once."""
        return self.min_iterations * self.read_once_s


def trace_floor(requests: Sequence[tuple[int, int]], rates: GemmRates, chunk: int, batch: int,
                read_once_s: float) -> TraceFloor:
    """requests: (prompt tokens, generated tokens) each; `chunk` and `batch` are rows in `rates`."""
    prompt = sum(p for p, _ in requests)
    generated = sum(g for _, g in requests)
    decode_rows = sum(max(g - 1, 0) for _, g in requests)
    per_tok = rates.best_layers(chunk) / chunk
    per_dec = rates.best_layers(batch) / batch
    per_head = rates.best_head(batch) / batch
    # a prompt needs ceil(p / chunk) iterations before its first token, then one per further token
    longest = max((-(-p // chunk) + g - 1 for p, g in requests), default=0)
    budget_iterations = -(-(prompt + decode_rows) // chunk)
    return TraceFloor(prompt, generated, prompt, decode_rows, generated, prompt * per_tok, decode_rows * per_dec,
                      generated * per_head, max(longest, budget_iterations), read_once_s)
