"""GPT-2: LayerNorms with biases, learned positions, biases everywhere, a plain GELU (tanh) MLP, and
Conv1D weights stored [in, out]."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_mq.models.info import ModelInfo, RopeSpec
from orca_mq.models.names import Names
from orca_mq.models.registry import Family, register

if TYPE_CHECKING:   # torch only where tensors are converted (workers): the launcher's check reads names
    from torch import Tensor

CONV1D = ("qkv", "o", "up", "down")


def from_hf(cfg: Any, path: Path) -> ModelInfo:
    if cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{path}: GPT-2 activation {cfg.activation_function!r} not supported")
    return ModelInfo(path=str(path), arch="gpt2", vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, n_layers=cfg.n_layer,
                     n_heads=cfg.n_head, n_kv_heads=cfg.n_head, intermediate_size=cfg.n_inner or 4 * cfg.n_embd,
                     norm_eps=cfg.layer_norm_epsilon, context_length=cfg.n_positions, rope=RopeSpec("none"),
                     tie_embeddings=True, bos_token_id=cfg.bos_token_id, norm="layer", act="gelu_tanh", gated_mlp=False,
                     qkv_bias=True, o_bias=True, mlp_bias=True)


def names(info: ModelInfo, gguf: bool) -> Names:
    def layer(i: int) -> dict[str, Any]:
        p = f"h.{i}."
        return {"attn_norm": f"{p}ln_1.weight", "attn_norm_b": f"{p}ln_1.bias", "ffn_norm": f"{p}ln_2.weight",
                "ffn_norm_b": f"{p}ln_2.bias", "qkv": f"{p}attn.c_attn.weight", "qkv_b": f"{p}attn.c_attn.bias",
                "o": f"{p}attn.c_proj.weight", "o_b": f"{p}attn.c_proj.bias", "up": f"{p}mlp.c_fc.weight",
                "up_b": f"{p}mlp.c_fc.bias", "down": f"{p}mlp.c_proj.weight", "down_b": f"{p}mlp.c_proj.bias"}

    return Names(layer, "wte.weight", {"w": "ln_f.weight", "b": "ln_f.bias"}, None, pos_embed="wpe.weight")


def transpose(info: ModelInfo, t: dict[str, Tensor], gguf: bool) -> dict[str, Tensor]:
    return {k: v.t() if k in CONV1D else v for k, v in t.items()}


register(Family("gpt2", ("gpt2",), ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "layer_norm_epsilon"),
                from_hf, names, convert=transpose))
