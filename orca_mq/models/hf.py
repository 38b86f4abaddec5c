"""What most families read alike from transformers' config object: the shape, the rotary, which layers
slide. A family file passes what sets it apart as ModelInfo options."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from orca_mq.models.info import ModelInfo, RopeSpec

KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


def rope_spec(params: dict[str, Any] | None, cfg: Any) -> RopeSpec:
    """transformers' rope_parameters (rope_theta and the scaling's own keys) as a RopeSpec."""
    p = dict(params or {})
    kind = p.pop("rope_type", p.pop("type", "default"))
    theta = float(p.pop("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0))
    p.pop("partial_rotary_factor", None)
    if kind in ("dynamic", "longrope"):
        p.setdefault("max_position_embeddings", cfg.max_position_embeddings)
    if kind == "longrope":
        p.setdefault("original_max_position_embeddings", getattr(cfg, "original_max_position_embeddings", None)
                     or cfg.max_position_embeddings)
    return RopeSpec(kind, theta, p)


def layer_types(cfg: Any) -> list[str]:
    """The config's own per-layer kinds (Qwen2/3, Gemma 2/3, gpt-oss)."""
    return [KINDS[t] for t in cfg.layer_types] if getattr(cfg, "layer_types", None) else []


def all_slide(cfg: Any) -> list[str]:
    """Every layer slides when the config sets a window (Mistral, Mixtral, Phi-3, Qwen3-MoE)."""
    return ["sliding"] * cfg.num_hidden_layers if getattr(cfg, "sliding_window", None) else []


def hf_info(cfg: Any, path: Path, arch: str, kinds: list[str] | None = None, **options: Any) -> ModelInfo:
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    params = getattr(cfg, "rope_parameters", None) or {}
    nested = "full_attention" in params
    glob = params["full_attention"] if nested else params
    kinds = layer_types(cfg) if kinds is None else kinds
    options.setdefault("rope", rope_spec(glob, cfg))
    if nested and "sliding_attention" in params:
        options.setdefault("rope_local", rope_spec(params["sliding_attention"], cfg))
    partial = float(glob.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))
    options.setdefault("context_length", context_length(cfg, options["rope"]))
    return ModelInfo(
        path=str(path), arch=arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers, n_heads=heads, n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        intermediate_size=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps,
        head_dim=head_dim, rotary_dim=int(head_dim * partial) if partial < 1 else 0, layer_kinds=kinds,
        sliding_window=(getattr(cfg, "sliding_window", None) or 0) if "sliding" in kinds else 0,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), bos_token_id=cfg.bos_token_id, **options)


def context_length(cfg: Any, rope: RopeSpec) -> int:
    """The longest context: max_position_embeddings, stretched by the scalings that extend it past the
    positions trained (dynamic NTK: factor x; yarn: factor x the original, as vLLM derives them)."""
    n = cfg.max_position_embeddings
    if rope.kind == "dynamic":
        return int(n * rope.params["factor"])
    if rope.kind == "yarn" and rope.params.get("original_max_position_embeddings"):
        return max(n, int(rope.params["original_max_position_embeddings"] * rope.params["factor"]))
    return n


LLAMA_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
