"""Phi-3 / Phi-4 (mini): q, k and v fused in qkv_proj and gate and up in gate_up_proj (the canonical
layout already; tensor parallelism splits them by rows), partial rotary, LongRoPE, a window on every
layer when the config sets one."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from orca_mq.models.gguf_meta import GGUFMeta
from orca_mq.models.gguf_rope import gguf_rope
from orca_mq.models.hf import LLAMA_KEYS, all_slide, hf_info
from orca_mq.models.info import ModelInfo
from orca_mq.models.names import gguf_names, hf_names
from orca_mq.models.registry import Family, register


def from_hf(cfg: Any, path: Path) -> ModelInfo:
    return hf_info(cfg, path, "phi3", kinds=all_slide(cfg))


def from_gguf(m: GGUFMeta) -> ModelInfo:
    info = m.info("phi3", rope=gguf_rope(m))
    if info.sliding_window:
        info.layer_kinds = ["sliding"] * info.n_layers
    return info


register(Family("phi3", ("phi3",), LLAMA_KEYS, from_hf,
                lambda info, gguf: gguf_names(info, fused=True) if gguf else hf_names(info, fused=True),
                gguf_arch="phi3", from_gguf=from_gguf))
