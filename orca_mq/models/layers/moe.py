"""A mixture of experts: the router as the config says, then every token's top-k experts.

The experts run grouped: the (token, expert) pairs sorted by expert, each expert's rows gathered into
one GEMM per projection (on the CPU a loop over the experts that have rows, never over tokens; on CUDA
kernels/fused_moe_kernel.py runs every expert of a projection in one launch, as vLLM's fused_moe), the
results weighted and summed back per token. Tensor parallelism splits each expert's intermediate
width (gate_up by rows, down by columns): one all-reduce for the layer's output.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from orca_mq.engine.layer_ops import LayerOps
from orca_mq.models.info import ModelInfo
from orca_mq.models.layers.mlp import gated

Tensor = torch.Tensor


class MoE:
    __slots__ = ("spec", "act", "reduce", "fused")

    def __init__(self, info: ModelInfo, ops: LayerOps, reduce: Callable[[Tensor], Tensor], fused: bool) -> None:
        assert info.moe is not None
        self.spec, self.act, self.reduce, self.fused = info.moe, gated(info, ops), reduce, fused

    def route(self, x: Tensor, w: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(expert ids [T, k], their weights [T, k] in x's dtype), as transformers' routers compute them."""
        logits = F.linear(x, w["router"], w.get("router_b"))
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
        if self.fused:
            from kernels.fused_moe_kernel import fused_moe

            out = fused_moe(x, w["experts_gate_up"], w["experts_down"], ids, weights, self.act,
                            w.get("experts_gate_up_b"), w.get("experts_down_b"))
        else:
            out = grouped(x, w["experts_gate_up"], w["experts_down"], ids, weights, self.act,
                          w.get("experts_gate_up_b"), w.get("experts_down_b"))
        return self.reduce(out)


def grouped(x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, act: Callable[[Tensor], Tensor],
            gate_up_b: Tensor | None = None, down_b: Tensor | None = None) -> Tensor:
    """The experts over their tokens: x [T, H], gate_up [E, 2I, H], down [E, H, I], ids / weights [T, k]."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // k)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    out = torch.empty(rows.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    at = 0
    for e, n in enumerate(counts):
        if n:
            seg = rows[at: at + n]
            h = act(F.linear(seg, gate_up[e], None if gate_up_b is None else gate_up_b[e]))
            out[at: at + n] = F.linear(h, down[e], None if down_b is None else down_b[e])
            at += n
    out *= weights.reshape(-1).index_select(0, order)[:, None]
    return torch.zeros_like(x).index_add_(0, order // k, out)
