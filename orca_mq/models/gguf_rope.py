"""A GGUF's rotary scaling as llama.cpp writes it: `rope.scaling.*` keys, or factor tensors (llama3's
rope_freqs, Phi-3's rope_factors_long / _short)."""
from __future__ import annotations

from orca_mq.models.gguf_meta import GGUFMeta
from orca_mq.models.info import RopeSpec


def gguf_rope(m: GGUFMeta, theta_key: str = "rope.freq_base") -> RopeSpec:
    theta = float(m.get(theta_key, m.get("rope.freq_base", 10000.0)))
    if "rope_freqs.weight" in m.shapes:   # llama3: per-frequency divisors, computed at conversion
        return RopeSpec("freq_factors", theta, {"factors": m.tensor("rope_freqs.weight")})
    if "rope_factors_long.weight" in m.shapes:
        original = int(m.get("rope.scaling.original_context_length"))
        return RopeSpec("longrope", theta, {
            "long_factor": m.tensor("rope_factors_long.weight"), "short_factor": m.tensor("rope_factors_short.weight"),
            "original_max_position_embeddings": original, "max_position_embeddings": int(m.get("context_length")),
            "attention_factor": m.get("rope.scaling.attn_factor", None), "factor": None})
    kind = str(m.get("rope.scaling.type", "none"))
    if kind == "linear":
        return RopeSpec("linear", theta, {"factor": float(m.get("rope.scaling.factor"))})
    if kind == "yarn":
        return RopeSpec("yarn", theta, {"factor": float(m.get("rope.scaling.factor")),
                                        "original_max_position_embeddings": int(m.get("rope.scaling.original_context_length"))})
    return RopeSpec("default", theta)
