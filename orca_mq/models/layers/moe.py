"""A mixture of experts: the router as the config says, then every token's top-k experts.

The experts run grouped: the (token, expert) pairs sorted by expert, each projection one call over
every expert's rows (on the CPU the extension's grouped_rows, float32 or bfloat16, which streams an
expert's few rows past its weight and gives a crowded expert one oneDNN product, or torch's grouped_mm
for other dtypes; on CUDA kernels/fused_moe_kernel.py's one launch per projection, as vLLM's
fused_moe), never a Python loop over tokens, the results weighted and summed back per token. Tensor
parallelism splits each expert's intermediate width (gate_up by rows, down by columns): one all-reduce
for the layer's output.

Deterministic mode (`invariant`: the engine's batch-invariant GEMM, engine/gemm.py) routes and runs each
expert's rows through that GEMM, a loop over the experts with rows: a row's bits then depend on nothing
else in the batch (the grouped calls switch kernels with an expert's row count).
"""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from orca_mq.engine.layer_ops import LayerOps
from orca_mq.models.info import ModelInfo
from orca_mq.models.layers.mlp import gated

Tensor = torch.Tensor


class MoE:
    __slots__ = ("spec", "act", "reduce", "fused", "invariant")

    def __init__(self, info: ModelInfo, ops: LayerOps, reduce: Callable[[Tensor], Tensor], fused: bool,
                 invariant: Callable[..., Tensor] | None = None) -> None:
        assert info.moe is not None
        self.spec, self.act, self.reduce, self.fused, self.invariant = info.moe, gated(info, ops), reduce, fused, invariant

    def route(self, x: Tensor, w: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(expert ids [T, k], their weights [T, k] in x's dtype), as transformers' routers compute them."""
        logits = (self.invariant or F.linear)(x, w["router"], w.get("router_b"))
        if self.spec.scoring == "softmax_topk":
            top, ids = torch.topk(torch.softmax(logits.float(), dim=-1), self.spec.top_k, dim=-1)
            if self.spec.renormalize:
                top = top / top.sum(dim=-1, keepdim=True)
        else:
            top, ids = torch.topk(logits, self.spec.top_k, dim=-1)
            top = torch.softmax(top, dim=-1)
        return ids, top.to(x.dtype)

    def __call__(self, x: Tensor, w: dict[str, Tensor]) -> Tensor:
        ids, weights = self.route(x, w)
        if self.invariant is not None:
            out = grouped(x, w["experts_gate_up"], w["experts_down"], ids, weights, self.act,
                          w.get("experts_gate_up_b"), w.get("experts_down_b"), self.invariant)
        elif self.fused:
            from kernels.fused_moe_kernel import fused_moe

            out = fused_moe(x, w["experts_gate_up"], w["experts_down"], ids, weights, self.act,
                            w.get("experts_gate_up_b"), w.get("experts_down_b"))
        else:
            out = grouped(x, w["experts_gate_up"], w["experts_down"], ids, weights, self.act,
                          w.get("experts_gate_up_b"), w.get("experts_down_b"))
        return self.reduce(out)


def grouped(x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, act: Callable[[Tensor], Tensor],
            gate_up_b: Tensor | None = None, down_b: Tensor | None = None,
            invariant: Callable[..., Tensor] | None = None) -> Tensor:
    """The experts over their tokens: x [T, H], gate_up [E, 2I, H], down [E, H, I], ids / weights [T, k];
    `invariant`: each expert's rows through this batch-invariant GEMM instead of one grouped call."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    ends = torch.cumsum(torch.bincount(flat, minlength=gate_up.shape[0]), 0)
    experts = flat.index_select(0, order) if gate_up_b is not None or down_b is not None else None
    run = _experts_linear if invariant is None else (lambda r, w, e, b, _: _each_expert(r, w, e, b, invariant))
    h = act(run(x.index_select(0, tokens), gate_up, ends, gate_up_b, experts))
    out = run(h, down, ends, down_b, experts)
    out *= weights.reshape(-1).index_select(0, order)[:, None]
    return torch.zeros_like(x).index_add_(0, tokens, out)


# An expert's rows are streamed past its weight (read from memory once) up to this many (decode: a few
# rows on each of many experts), one oneDNN product beyond (prefill). Where the two cross depends on the
# host's oneDNN (tools/bench_moe.py --crossover, float32, hidden 1024, one thread): at 12 rows on an
# AVX-512 host (16 rows streamed 1.24x its time), near 28 with oneDNN held to AVX2 (16 rows: 0.79x)
STREAM_ROWS = 16
STREAM_DTYPES = (torch.float32, torch.bfloat16)


def _experts_linear(rows: Tensor, w: Tensor, ends: Tensor, b: Tensor | None, experts: Tensor | None) -> Tensor:
    """rows [N, in], sorted by expert, whose expert e's end at ends[e], times w [E, out, in]: one call."""
    if (ext := _stream_kernels(rows, w)) is not None:
        y = ext.grouped_rows(rows, w, ends, STREAM_ROWS)
    elif w.shape[1] * w.element_size() % 16 == 0 and w.shape[2] * w.element_size() % 16 == 0:
        y = F.grouped_mm(rows, w.transpose(1, 2), offs=ends.to(torch.int32))
    else:   # grouped_mm takes rows of whole 16 bytes only: other widths loop over the experts
        y = _each_expert(rows, w, ends, None, F.linear)
    return y if b is None else y.add_(b.index_select(0, experts))


def _each_expert(rows: Tensor, w: Tensor, ends: Tensor, b: Tensor | None, linear: Callable[..., Tensor]) -> Tensor:
    """rows sorted by expert times their expert's w [E, out, in] (+ b [E, out]), an expert at a time."""
    bounds = [0, *ends.tolist()]
    parts = [linear(rows[lo:hi], w[e], None if b is None else b[e])
             for e, (lo, hi) in enumerate(zip(bounds, bounds[1:])) if hi > lo]
    return torch.cat(parts) if parts else rows.new_empty(0, w.shape[1])


def _stream_kernels(rows: Tensor, w: Tensor) -> ModuleType | None:
    """The CPU extension where its grouped_rows takes these tensors (both float32 or both bfloat16,
    contiguous, in % 8 == 0)."""
    if rows.device.type != "cpu" or rows.dtype != w.dtype or w.dtype not in STREAM_DTYPES or w.shape[2] % 8 \
            or not w.is_contiguous():
        return None
    from kernels import cpu_kernels

    return cpu_kernels.load()
