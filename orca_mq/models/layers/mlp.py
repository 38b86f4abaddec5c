"""The feed-forward half of a layer: a gated MLP (SwiGLU, GeGLU, gpt-oss' clamped SwiGLU), GPT-2's plain
one, or a mixture of experts (models/layers/moe.py), each ending in the tensor-parallel all-reduce."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from orca_mq.engine.layer_ops import LayerOps
from orca_mq.models.info import ModelInfo

Tensor = torch.Tensor
Linear = Callable[..., Tensor]


def gated(info: ModelInfo, ops: LayerOps) -> Callable[[Tensor], Tensor]:
    """[T, 2n] = [gate | up] -> [T, n] for the model's activation."""
    if info.act == "silu":
        return ops.silu_mul
    if info.act == "gelu_tanh":
        return gelu_mul
    limit, alpha = info.swiglu_limit, info.swiglu_alpha

    def swiglu_oss(gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))

    return swiglu_oss


def gelu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class DenseMLP:
    __slots__ = ("linear", "act", "reduce", "gated")

    def __init__(self, info: ModelInfo, ops: LayerOps, linear: Linear, reduce: Callable[[Tensor], Tensor]) -> None:
        self.linear, self.reduce, self.gated = linear, reduce, info.gated_mlp
        self.act = gated(info, ops) if info.gated_mlp else (lambda x: F.gelu(x, approximate="tanh"))

    def __call__(self, x: Tensor, w: dict[str, Tensor]) -> Tensor:
        up = self.linear(x, w["gate_up"], w.get("gate_up_b")) if self.gated else self.linear(x, w["up"], w.get("up_b"))
        return self.reduce(self.linear(self.act(up), w["down"], w.get("down_b")))
