"""gpt-oss: attention sinks, alternating windowed / full layers, q/k/v and output biases, yarn rotary, a
router with a bias (top-k of its logits, then a softmax over them), experts with biases and a clamped
SwiGLU; the experts' MXFP4 weights are dequantized at load (models/sources.py)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_mq.models.hf import LLAMA_KEYS, hf_info
from orca_mq.models.info import ModelInfo, MoESpec
from orca_mq.models.names import Names, hf_layer
from orca_mq.models.registry import Family, register

if TYPE_CHECKING:   # torch only where tensors are converted (workers): the launcher's check reads names
    from torch import Tensor


def from_hf(cfg: Any, path: Path) -> ModelInfo:
    moe = MoESpec(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, scoring="topk_softmax",
                  renormalize=False, bias=True)
    return hf_info(cfg, path, "gpt_oss", sinks=True, qkv_bias=True, o_bias=True, act="swiglu_oss",
                   swiglu_limit=float(cfg.swiglu_limit), swiglu_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)), moe=moe)


def names(info: ModelInfo, gguf: bool) -> Names:
    def layer(i: int) -> dict[str, Any]:
        out = hf_layer(info, i, experts=("mlp.router", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        p = f"model.layers.{i}.mlp."
        return out | {"router_b": f"{p}router.bias", "experts_gate_up_b": f"{p}experts.gate_up_proj_bias",
                      "experts_down_b": f"{p}experts.down_proj_bias"}

    return Names(layer, "model.embed_tokens.weight", {"w": "model.norm.weight"},
                 None if info.tie_embeddings else "lm_head.weight")


def deinterleave(info: ModelInfo, t: dict[str, Tensor], gguf: bool) -> dict[str, Tensor]:
    """Its experts hold [in, out] with gate and up interleaved by column: [out, in] with gate's rows first."""
    import torch

    if "experts_gate_up" not in t:
        return t
    gu, b = t["experts_gate_up"].transpose(1, 2), t["experts_gate_up_b"]
    return t | {"experts_gate_up": torch.cat([gu[:, 0::2], gu[:, 1::2]], 1),
                "experts_gate_up_b": torch.cat([b[:, 0::2], b[:, 1::2]], 1),
                "experts_down": t["experts_down"].transpose(1, 2)}


register(Family("gpt_oss", ("gpt_oss",), (*LLAMA_KEYS, "num_local_experts", "num_experts_per_tok"), from_hf, names,
                convert=deinterleave))
