"""Mixtral: Mistral's layer with a mixture of experts (softmax over the experts, top-k, renormalised);
llama.cpp writes it as llama with experts (llama.py reads those GGUFs into this layout)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from orca_mq.models.hf import LLAMA_KEYS, all_slide, hf_info
from orca_mq.models.info import ModelInfo, MoESpec
from orca_mq.models.llama import unpermute
from orca_mq.models.names import gguf_names, hf_names
from orca_mq.models.registry import Family, register

EXPERTS = ("block_sparse_moe.gate", ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
           "block_sparse_moe.experts.{e}.w2.weight")


def from_hf(cfg: Any, path: Path) -> ModelInfo:
    moe = MoESpec(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size)
    return hf_info(cfg, path, "mixtral", kinds=all_slide(cfg), moe=moe)


register(Family("mixtral", ("mixtral",), (*LLAMA_KEYS, "num_local_experts", "num_experts_per_tok"), from_hf,
                lambda info, gguf: gguf_names(info) if gguf else hf_names(info, experts=EXPERTS), convert=unpermute))
