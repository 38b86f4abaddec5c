"""Weights from a GGUF file (Llama) or a Hugging Face safetensors dir (Llama, GPT-2).

Weights come out in one canonical per-layer layout (fused QKV and gate/up, [out, in] matrices)
so the model code does not care where they came from. A pipeline stage loads only its layers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from orca_mq.engine.model_info import ModelInfo, cache_key, gguf_reader

Tensor = torch.Tensor
MATRICES = ("qkv", "o", "gate_up", "down", "fc", "proj")   # a layer's GEMM weights, [out, in]


# ---------------------------------------------------------------- weights

@dataclass(slots=True)
class StageWeights:
    """The tensors one pipeline stage needs; names are the canonical ones the model reads."""

    layers: list[dict[str, Tensor]]
    embed: Tensor | None = None        # stage 0 (and the last stage when the LM head is tied)
    pos_embed: Tensor | None = None    # GPT-2, stage 0
    final_norm: dict[str, Tensor] | None = None
    lm_head: Tensor | None = None


def load_stage_weights(info: ModelInfo, layers: range, first: bool, last: bool, dtype: torch.dtype,
                       cache_dir: str = "") -> StageWeights:
    """A stage's weights; with `cache_dir`, a GGUF's dequantized tensors are saved there once and
    memory-mapped afterwards (seconds instead of a minute of dequantizing when a worker restarts)."""
    path = Path(info.path)
    if not cache_dir or not path.is_file():
        return _load(info, layers, first, last, dtype)
    cached = Path(cache_dir).expanduser() / f"stage-{cache_key(path, layers.start, layers.stop, first, last, str(dtype))}.pt"
    try:
        return StageWeights(**torch.load(cached, mmap=True, weights_only=True))
    except (OSError, RuntimeError, TypeError, ValueError):
        pass  # missing, stale or torn: load and save again
    out = _load(info, layers, first, last, dtype)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
    torch.save({name: getattr(out, name) for name in StageWeights.__dataclass_fields__}, tmp)
    os.replace(tmp, cached)
    return out


def _load(info: ModelInfo, layers: range, first: bool, last: bool, dtype: torch.dtype) -> StageWeights:
    path = Path(info.path)
    raw = _GGUFSource(path, info) if path.is_file() else _SafetensorsSource(path)
    canon = _LLAMA_NAMES_GGUF if path.is_file() else (_LLAMA_NAMES_HF if info.arch == "llama" else _GPT2_NAMES)

    def get(name: str) -> Tensor:
        return raw.get(name).to(dtype).contiguous()

    out = StageWeights(layers=[])
    for i in layers:
        t = {k: get(v.format(i=i)) for k, v in canon["layer"].items()}
        out.layers.append(_fuse(info, t))
    if first:
        out.embed = get(canon["embed"])
        if info.arch == "gpt2":
            out.pos_embed = get(canon["pos_embed"])
    if last:
        out.final_norm = {k: get(v) for k, v in canon["final_norm"].items()}
        head = canon["lm_head"]
        out.lm_head = get(head) if head and raw.has(head) else (out.embed if out.embed is not None else get(canon["embed"]))
    return out


def _fuse(info: ModelInfo, t: dict[str, Tensor]) -> dict[str, Tensor]:
    """One matmul for Q, K and V, one for gate and up: fewer, larger GEMMs for every stage."""
    if info.arch == "llama":
        return {
            "attn_norm": t["attn_norm"], "ffn_norm": t["ffn_norm"],
            "qkv": torch.cat([t["q"], t["k"], t["v"]]).contiguous(), "o": t["o"],
            "gate_up": torch.cat([t["gate"], t["up"]]).contiguous(), "down": t["down"],
        }
    # GPT-2's Conv1D stores [in, out]; transpose to the [out, in] every linear here uses
    return {
        "ln1_w": t["ln1_w"], "ln1_b": t["ln1_b"], "ln2_w": t["ln2_w"], "ln2_b": t["ln2_b"],
        "qkv": t["qkv"].t().contiguous(), "qkv_b": t["qkv_b"], "o": t["o"].t().contiguous(), "o_b": t["o_b"],
        "fc": t["fc"].t().contiguous(), "fc_b": t["fc_b"], "proj": t["proj"].t().contiguous(), "proj_b": t["proj_b"],
    }


_LLAMA_NAMES_GGUF = {
    "layer": {
        "attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
        "q": "blk.{i}.attn_q.weight", "k": "blk.{i}.attn_k.weight", "v": "blk.{i}.attn_v.weight",
        "o": "blk.{i}.attn_output.weight", "gate": "blk.{i}.ffn_gate.weight", "up": "blk.{i}.ffn_up.weight",
        "down": "blk.{i}.ffn_down.weight",
    },
    "embed": "token_embd.weight", "final_norm": {"w": "output_norm.weight"}, "lm_head": "output.weight",
}
_LLAMA_NAMES_HF = {
    "layer": {
        "attn_norm": "model.layers.{i}.input_layernorm.weight",
        "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
        "q": "model.layers.{i}.self_attn.q_proj.weight", "k": "model.layers.{i}.self_attn.k_proj.weight",
        "v": "model.layers.{i}.self_attn.v_proj.weight", "o": "model.layers.{i}.self_attn.o_proj.weight",
        "gate": "model.layers.{i}.mlp.gate_proj.weight", "up": "model.layers.{i}.mlp.up_proj.weight",
        "down": "model.layers.{i}.mlp.down_proj.weight",
    },
    "embed": "model.embed_tokens.weight", "final_norm": {"w": "model.norm.weight"}, "lm_head": "lm_head.weight",
}
_GPT2_NAMES = {
    "layer": {
        "ln1_w": "h.{i}.ln_1.weight", "ln1_b": "h.{i}.ln_1.bias", "ln2_w": "h.{i}.ln_2.weight",
        "ln2_b": "h.{i}.ln_2.bias", "qkv": "h.{i}.attn.c_attn.weight", "qkv_b": "h.{i}.attn.c_attn.bias",
        "o": "h.{i}.attn.c_proj.weight", "o_b": "h.{i}.attn.c_proj.bias", "fc": "h.{i}.mlp.c_fc.weight",
        "fc_b": "h.{i}.mlp.c_fc.bias", "proj": "h.{i}.mlp.c_proj.weight", "proj_b": "h.{i}.mlp.c_proj.bias",
    },
    "embed": "wte.weight", "pos_embed": "wpe.weight", "final_norm": {"w": "ln_f.weight", "b": "ln_f.bias"},
    "lm_head": None,
}


class _GGUFSource:
    def __init__(self, path: Path, info: ModelInfo) -> None:
        self.tensors = {t.name: t for t in gguf_reader(path).tensors}
        self.info = info

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> Tensor:
        from gguf import GGMLQuantizationType, dequantize

        if name not in self.tensors:
            raise KeyError(f"{self.info.path}: tensor {name} missing")
        t = self.tensors[name]
        plain = t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        data = np.array(t.data, dtype=np.float32) if plain else dequantize(t.data, t.tensor_type)  # copy: the reader's mmap is read-only
        w = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).reshape(tuple(reversed([int(d) for d in t.shape])))
        # llama.cpp permutes Q/K rows for its interleaved rotary; undo it for the rotate-half form used here
        if name.endswith("attn_q.weight"):
            w = _unpermute(w, self.info.n_heads)
        elif name.endswith("attn_k.weight"):
            w = _unpermute(w, self.info.n_kv_heads)
        return w


def _unpermute(w: Tensor, n_head: int) -> Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _SafetensorsSource:
    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.handles = {}
        for f in sorted(path.glob("*.safetensors")):
            h = safe_open(str(f), framework="pt")
            for k in h.keys():
                self.handles[k] = h
        if not self.handles:
            raise FileNotFoundError(f"{path}: no *.safetensors files")

    def _key(self, name: str) -> str | None:
        for k in (name, f"transformer.{name}"):
            if k in self.handles:
                return k
        return None

    def has(self, name: str) -> bool:
        return self._key(name) is not None

    def get(self, name: str) -> Tensor:
        key = self._key(name)
        if key is None:
            raise KeyError(f"tensor {name} missing")
        return self.handles[key].get_tensor(key).float()
