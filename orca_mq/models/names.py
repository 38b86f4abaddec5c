"""Where a family's tensors are in a checkpoint, by the canonical names the layer code reads.

Canonical layout ([out, in] matrices; projections that read the same input fused, so each is one GEMM):
  per layer  attn_norm (+_b), qkv (+_b), q_norm, k_norm, o (+_b), sinks, post_attn_norm,
             ffn_norm (+_b), gate_up (+_b) | up (+_b) (GPT-2's plain MLP), down (+_b), post_ffn_norm,
             router (+_b), experts_gate_up [E, 2I, H] (+_b), experts_down [E, H, I] (+_b)
  stage      embed, pos_embed (GPT-2), final_norm {w, b}, lm_head
A source is one tensor name or several whose rows are concatenated (q, k and v into qkv); a name with
`{e}` is read for every expert and stacked. `expected_shapes`: each canonical tensor's shape for a config.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orca_mq.models.info import ModelInfo

Source = str | tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Names:
    layer: Callable[[int], dict[str, Source]]
    embed: str
    final_norm: dict[str, str]
    lm_head: str | None            # None: the head is the embedding (tied)
    pos_embed: str | None = None


def attention(info: ModelInfo, qkv: tuple[str, ...], o: str, q_norm: str, k_norm: str) -> dict[str, Source]:
    """A layer's attention tensors by module name (either kind of checkpoint), with the biases and
    q/k norms the family has."""
    out: dict[str, Source] = {"qkv": tuple(f"{m}.weight" for m in qkv), "o": f"{o}.weight"}
    if info.qkv_bias:
        out["qkv_b"] = tuple(f"{m}.bias" for m in qkv)
    if info.o_bias:
        out["o_b"] = f"{o}.bias"
    if info.qk_norm:
        out["q_norm"], out["k_norm"] = f"{q_norm}.weight", f"{k_norm}.weight"
    return out


# ---------------------------------------------------------------- Hugging Face (transformers' module names)

def hf_layer(info: ModelInfo, i: int, *, norms: dict[str, str] | None = None, fused: bool = False,
             experts: tuple[str, Source, str] | None = None) -> dict[str, Source]:
    """A Llama-shaped layer's names: `norms` canonical -> module (default: Llama's two), `fused`:
    qkv_proj and gate_up_proj stored fused (Phi-3), `experts`: (router, expert gate_up, expert down)
    module names for this layer when it has experts."""
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    out: dict[str, Source] = {k: f"{p}{v}.weight" for k, v in (norms or LLAMA_NORMS).items()}
    qkv = ("qkv_proj",) if fused else ("q_proj", "k_proj", "v_proj")
    out |= attention(info, tuple(a + m for m in qkv), f"{a}o_proj", f"{a}q_norm", f"{a}k_norm")
    if info.sinks:
        out["sinks"] = f"{a}sinks"
    if experts is not None and info.is_moe(i):
        router, gate_up, down = experts
        out["router"] = f"{p}{router}.weight"
        out["experts_gate_up"] = tuple(f"{p}{s}" for s in ((gate_up,) if isinstance(gate_up, str) else gate_up))
        out["experts_down"] = f"{p}{down}"
        return out
    gate_up = ("mlp.gate_up_proj",) if fused else ("mlp.gate_proj", "mlp.up_proj")
    out["gate_up"] = tuple(f"{p}{m}.weight" for m in gate_up)
    out["down"] = f"{p}mlp.down_proj.weight"
    if info.mlp_bias:
        out["gate_up_b"] = tuple(f"{p}{m}.bias" for m in gate_up)
        out["down_b"] = f"{p}mlp.down_proj.bias"
    return out


LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffn_norm": "post_feedforward_layernorm"}


def hf_names(info: ModelInfo, **layer_options: object) -> Names:
    return Names(lambda i: hf_layer(info, i, **layer_options),  # type: ignore[arg-type]
                 "model.embed_tokens.weight", {"w": "model.norm.weight"},
                 None if info.tie_embeddings else "lm_head.weight")


# ---------------------------------------------------------------- GGUF (llama.cpp's tensor names)

def gguf_layer(info: ModelInfo, i: int, *, fused: bool = False) -> dict[str, Source]:
    b = f"blk.{i}."
    out: dict[str, Source] = {"attn_norm": f"{b}attn_norm.weight", "ffn_norm": f"{b}ffn_norm.weight"}
    if info.sandwich_norms:
        out["post_attn_norm"], out["post_ffn_norm"] = f"{b}post_attention_norm.weight", f"{b}post_ffw_norm.weight"
    qkv = ("attn_qkv",) if fused else ("attn_q", "attn_k", "attn_v")
    out |= attention(info, tuple(b + m for m in qkv), f"{b}attn_output", f"{b}attn_q_norm", f"{b}attn_k_norm")
    if info.is_moe(i):
        out["router"] = f"{b}ffn_gate_inp.weight"
        out["experts_gate_up"] = (f"{b}ffn_gate_exps.weight", f"{b}ffn_up_exps.weight")   # [E, I, H] each: rows of each expert
        out["experts_down"] = f"{b}ffn_down_exps.weight"
    else:
        out["gate_up"] = (f"{b}ffn_up.weight",) if fused else (f"{b}ffn_gate.weight", f"{b}ffn_up.weight")
        out["down"] = f"{b}ffn_down.weight"
    return out


def gguf_names(info: ModelInfo, **layer_options: object) -> Names:
    return Names(lambda i: gguf_layer(info, i, **layer_options),  # type: ignore[arg-type]
                 "token_embd.weight", {"w": "output_norm.weight"}, "output.weight")


def names_of(info: ModelInfo) -> Names:
    """The checkpoint's names of the canonical tensors (its family's, for a GGUF or a directory)."""
    from orca_mq.models.registry import family

    return family(info.arch).names(info, Path(info.path).is_file())


def expected_shapes(info: ModelInfo) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor's shape for this config (the ones a layer or stage holds are a subset)."""
    h, d, inter = info.hidden_size, info.head_dim, info.intermediate_size
    qkv = (info.n_heads + 2 * info.n_kv_heads) * d
    s: dict[str, tuple[int, ...]] = {
        "qkv": (qkv, h), "qkv_b": (qkv,), "o": (h, info.n_heads * d), "o_b": (h,), "q_norm": (d,), "k_norm": (d,),
        "sinks": (info.n_heads,), "gate_up": (2 * inter, h), "gate_up_b": (2 * inter,), "up": (inter, h),
        "up_b": (inter,), "down": (h, inter), "down_b": (h,), "embed": (info.vocab_size, h),
        "lm_head": (info.vocab_size, h), "pos_embed": (info.context_length, h),
    }
    for k in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "final_norm"):
        s[k] = s[k + "_b"] = (h,)
    if info.moe is not None:
        e, i = info.moe.n_experts, info.moe.intermediate_size
        s |= {"router": (e, h), "router_b": (e,), "experts_gate_up": (e, 2 * i, h), "experts_gate_up_b": (e, 2 * i),
              "experts_down": (e, h, i), "experts_down_b": (e, h)}
    return s
