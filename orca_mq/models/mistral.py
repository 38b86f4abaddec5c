"""Mistral / Ministral: Llama's layout with a sliding window on every layer when the config sets one
(llama.cpp writes Mistral as llama: its GGUFs load through llama.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from orca_mq.models.hf import LLAMA_KEYS, all_slide, hf_info
from orca_mq.models.info import ModelInfo
from orca_mq.models.names import hf_names
from orca_mq.models.registry import Family, register


def from_hf(cfg: Any, path: Path) -> ModelInfo:
    return hf_info(cfg, path, "mistral", kinds=all_slide(cfg))


register(Family("mistral", ("mistral", "ministral"), LLAMA_KEYS, from_hf, lambda info, gguf: hf_names(info)))
