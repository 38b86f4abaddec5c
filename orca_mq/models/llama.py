"""Llama 1-3 and what shares its layout (SmolLM, TinyLlama, Llama 3.1 / 3.2 with llama3 rope scaling):
explicit head_dim, attention and MLP bias flags, tied or untied head."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_mq.models.gguf_meta import GGUFMeta
from orca_mq.models.gguf_rope import gguf_rope
from orca_mq.models.hf import LLAMA_KEYS, hf_info
from orca_mq.models.info import ModelInfo, MoESpec
from orca_mq.models.names import gguf_names, hf_names
from orca_mq.models.registry import Family, register

if TYPE_CHECKING:   # torch only where tensors are converted (workers): the launcher's check reads names
    from torch import Tensor


def from_hf(cfg: Any, path: Path) -> ModelInfo:
    bias = bool(getattr(cfg, "attention_bias", False))
    return hf_info(cfg, path, "llama", kinds=[], qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


def from_gguf(m: GGUFMeta) -> ModelInfo:
    """llama.cpp writes Mistral and Mixtral as llama too: experts make it Mixtral's layout."""
    experts = int(m.get("expert_count", 0) or 0)
    moe = MoESpec(experts, int(m.get("expert_used_count")), int(m.get("feed_forward_length"))) if experts else None
    info = m.info("mixtral" if moe else "llama", rope=gguf_rope(m), moe=moe)
    if info.sliding_window:
        info.layer_kinds = ["sliding"] * info.n_layers
    return info


def unpermute(info: ModelInfo, t: dict[str, Tensor], gguf: bool) -> dict[str, Tensor]:
    """llama.cpp permutes Q/K rows (and biases) for its interleaved rotary; back to the rotate-half form used here."""
    import torch

    if not gguf or "qkv" not in t:
        return t
    q, k = info.n_heads * info.head_dim, info.n_kv_heads * info.head_dim
    return t | {name: torch.cat([_unpermute(w[:q], info.n_heads), _unpermute(w[q:q + k], info.n_kv_heads), w[q + k:]])
                for name, w in t.items() if name in ("qkv", "qkv_b")}


def _unpermute(w: Tensor, n_head: int) -> Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


register(Family("llama", ("llama",), LLAMA_KEYS, from_hf,
                lambda info, gguf: gguf_names(info) if gguf else hf_names(info),
                gguf_arch="llama", from_gguf=from_gguf, convert=unpermute))
