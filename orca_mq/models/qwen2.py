"""Qwen2 / Qwen2.5: q, k and v biases (no output bias), tied embeddings in the small sizes, yarn scaling in
the long-context releases, sliding layers only where use_sliding_window says."""
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
    return hf_info(cfg, path, "qwen2", qkv_bias=True)


def from_gguf(m: GGUFMeta) -> ModelInfo:
    return m.info("qwen2", rope=gguf_rope(m))


register(Family("qwen2", ("qwen2",), LLAMA_KEYS, from_hf,
                lambda info, gguf: gguf_names(info) if gguf else hf_names(info),
                gguf_arch="qwen2", from_gguf=from_gguf))
