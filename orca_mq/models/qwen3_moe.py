"""Qwen3-MoE: Qwen3's attention (q/k norms) with a mixture of experts in the layers decoder_sparse_step and
mlp_only_layers say (softmax, top-k, renormalised when norm_topk_prob)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from orca_mq.models.gguf_meta import GGUFMeta
from orca_mq.models.gguf_rope import gguf_rope
from orca_mq.models.hf import LLAMA_KEYS, all_slide, hf_info
from orca_mq.models.info import ModelInfo, MoESpec
from orca_mq.models.names import gguf_names, hf_names
from orca_mq.models.registry import Family, register

EXPERTS = ("mlp.gate", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
           "mlp.experts.{e}.down_proj.weight")


def from_hf(cfg: Any, path: Path) -> ModelInfo:
    step, dense = cfg.decoder_sparse_step, set(cfg.mlp_only_layers or ())
    sparse = [i for i in range(cfg.num_hidden_layers) if i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0]
    moe = MoESpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, renormalize=bool(cfg.norm_topk_prob),
                  sparse_layers=None if len(sparse) == cfg.num_hidden_layers else sparse)
    bias = bool(getattr(cfg, "attention_bias", False))
    return hf_info(cfg, path, "qwen3_moe", kinds=all_slide(cfg), qk_norm=True, qkv_bias=bias, o_bias=bias, moe=moe)


def from_gguf(m: GGUFMeta) -> ModelInfo:
    moe = MoESpec(int(m.get("expert_count")), int(m.get("expert_used_count")), int(m.get("expert_feed_forward_length")))
    return m.info("qwen3_moe", rope=gguf_rope(m), qk_norm=True, moe=moe)


register(Family("qwen3_moe", ("qwen3_moe",), (*LLAMA_KEYS, "num_experts|num_local_experts", "num_experts_per_tok", "moe_intermediate_size"),
                from_hf, lambda info, gguf: gguf_names(info) if gguf else hf_names(info, experts=EXPERTS),
                gguf_arch="qwen3moe", from_gguf=from_gguf))
