"""Gemma 3 (text): Gemma 2's layer with (1 + w) RMSNorms on each q and k head, local / global layers in
its pattern (five in six slide), a rotary base (and scaling) per layer kind, no soft-capping by default."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from orca_mq.models.gemma2 import gemma_gguf, gemma_options, names, one_plus
from orca_mq.models.gguf_meta import GGUFMeta
from orca_mq.models.gguf_rope import gguf_rope
from orca_mq.models.hf import LLAMA_KEYS, hf_info
from orca_mq.models.info import ModelInfo, RopeSpec
from orca_mq.models.registry import Family, register


def from_hf(cfg: Any, path: Path) -> ModelInfo:
    return hf_info(cfg, path, "gemma3", qk_norm=True, **gemma_options(cfg))


def from_gguf(m: GGUFMeta) -> ModelInfo:
    """The sliding layers: a flag per layer, or every n-th layer full (llama.cpp's default for Gemma 3: 6)."""
    pattern = m.get("attention.sliding_window_pattern", 6)
    info = gemma_gguf(m, "gemma3", qk_norm=True, rope=gguf_rope(m),
                      rope_local=RopeSpec("default", float(m.get("rope.freq_base_swa", 10000.0))))
    slides = [bool(b) for b in pattern] if isinstance(pattern, list) else [(i + 1) % int(pattern) != 0 for i in range(info.n_layers)]
    info.layer_kinds = ["sliding" if b else "full" for b in slides]
    return info


register(Family("gemma3", ("gemma3_text",), (*LLAMA_KEYS, "query_pre_attn_scalar"), from_hf, names,
                gguf_arch="gemma3", from_gguf=from_gguf, convert=one_plus))
