"""What a model runner's weights take in memory, for the engine benchmarks' tables."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orca_mq.engine.model_runner import ModelRunner


def weight_bytes(runner: "ModelRunner") -> int:
    """Bytes of the loaded weights: every layer's tensors, the final norm, embeddings and LM head (a tied head once)."""
    w = runner.model.w
    tensors = {id(t): t for t in [*(t for layer in w.layers for t in layer.values()), *(w.final_norm or {}).values(),
                                  w.embed, w.pos_embed, w.lm_head] if t is not None}   # a tied head counts once
    return sum(t.numel() * t.element_size() for t in tensors.values())
