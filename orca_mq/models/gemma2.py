"""Gemma 2: attention and final logit soft-capping, alternating local / global layers, the attention scale
from query_pre_attn_scalar, (1 + w) RMSNorms before and after attention and the MLP, GeGLU (tanh GELU),
embeddings scaled by sqrt(hidden). The norms' 1 + w is folded into w at load (llama.cpp's GGUFs hold it so)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_mq.models.gguf_meta import GGUFMeta
from orca_mq.models.hf import LLAMA_KEYS, hf_info
from orca_mq.models.info import ModelInfo
from orca_mq.models.names import GEMMA_NORMS, gguf_names, hf_names
from orca_mq.models.registry import Family, register

if TYPE_CHECKING:   # torch only where tensors are converted (workers): the launcher's check reads names
    from torch import Tensor

NORMS = ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm", "q_norm", "k_norm", "final_norm")


def gemma_options(cfg: Any) -> dict[str, Any]:
    return dict(sandwich_norms=True, act="gelu_tanh",
                attn_scale=cfg.query_pre_attn_scalar ** -0.5, attn_softcap=getattr(cfg, "attn_logit_softcapping", None) or 0.0,
                final_softcap=getattr(cfg, "final_logit_softcapping", None) or 0.0, embed_scale=cfg.hidden_size ** 0.5)


def from_hf(cfg: Any, path: Path) -> ModelInfo:
    return hf_info(cfg, path, "gemma2", **gemma_options(cfg))


def gemma_gguf(m: GGUFMeta, arch: str, **options: Any) -> ModelInfo:
    """Gemma 2 / 3 GGUFs: every other layer (2) or five in six (3) slide, as llama.cpp lays them."""
    heads, h = int(m.get("attention.head_count")), int(m.get("embedding_length"))
    head_dim = int(m.get("attention.key_length", 0)) or h // heads
    # query_pre_attn_scalar is not in llama.cpp's GGUFs: it takes head_dim, but hidden / heads for Gemma 2 27B
    # (its 46 layers), as Google's configs set it; a file that states attention.scale wins
    scale = m.get("attention.scale", None) or (h // heads if int(m.get("block_count")) == 46 else head_dim) ** -0.5
    return m.info(arch, sandwich_norms=True, act="gelu_tanh", attn_scale=float(scale), embed_scale=h ** 0.5, **options)


def from_gguf(m: GGUFMeta) -> ModelInfo:
    info = gemma_gguf(m, "gemma2", attn_softcap=float(m.get("attn_logit_softcapping", 0) or 0),
                      final_softcap=float(m.get("final_logit_softcapping", 0) or 0))
    info.layer_kinds = ["sliding" if i % 2 == 0 else "full" for i in range(info.n_layers)]
    return info


def one_plus(info: ModelInfo, t: dict[str, Tensor], gguf: bool) -> dict[str, Tensor]:
    """Gemma's RMSNorm multiplies by 1 + w: w + 1 at load (a GGUF's already are)."""
    return t if gguf else {k: v + 1 if k in NORMS else v for k, v in t.items()}


def names(info: ModelInfo, gguf: bool):  # type: ignore[no-untyped-def]
    return gguf_names(info) if gguf else hf_names(info, norms=GEMMA_NORMS)


register(Family("gemma2", ("gemma2",), (*LLAMA_KEYS, "query_pre_attn_scalar"), from_hf, names,
                gguf_arch="gemma2", from_gguf=from_gguf, convert=one_plus))
