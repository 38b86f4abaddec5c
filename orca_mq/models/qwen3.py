"""Qwen3 (dense): an RMSNorm over each q and k head before rotary, head_dim independent of hidden / heads,
no biases unless attention_bias."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from orca_mq.models.gguf_meta import GGUFMeta
from orca_mq.models.gguf_rope import gguf_rope
from orca_mq.models.hf import LLAMA_KEYS, hf_info
from orca_mq.models.info import ModelInfo
from orca_mq.models.names import gguf_names, hf_names
from orca_mq.models.registry import Family, register


def from_hf(cfg: Any, path: Path) -> ModelInfo:
    bias = bool(getattr(cfg, "attention_bias", False))
    return hf_info(cfg, path, "qwen3", qk_norm=True, qkv_bias=bias, o_bias=bias)


def from_gguf(m: GGUFMeta) -> ModelInfo:
    return m.info("qwen3", rope=gguf_rope(m), qk_norm=True)


register(Family("qwen3", ("qwen3",), LLAMA_KEYS, from_hf,
                lambda info, gguf: gguf_names(info) if gguf else hf_names(info),
                gguf_arch="qwen3", from_gguf=from_gguf))
