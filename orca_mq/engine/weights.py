"""Model metadata and weights from a GGUF file (Llama) or a Hugging Face safetensors dir (Llama, GPT-2).

Weights come out in one canonical per-layer layout (fused QKV and gate/up, [out, in] matrices)
so the model code does not care where they came from. A pipeline stage loads only its layers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from orca_mq.engine.model_files import resolve_model_path

if TYPE_CHECKING:
    from orca_mq.config import Config

Tensor = torch.Tensor


@dataclass(slots=True)
class ModelInfo:
    path: str
    arch: str                      # "llama" | "gpt2"
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    norm_eps: float
    context_length: int
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def max_model_len(self, cfg: "Config") -> int:
        return min(cfg.model.max_model_len, self.context_length)

    def stage_layers(self, stage: int, n_stages: int) -> range:
        """Contiguous inter-layer partition balancing work per stage. The last stage also runs the LM
        head (vocab x hidden per request and iteration), counted as layers' worth of parameters at
        half weight: a middle ground between decode-heavy iterations (head ~ every token) and
        prefill-heavy ones (head on one token of many)."""
        if not 1 <= n_stages <= self.n_layers:
            raise ValueError(f"n_workers={n_stages} must be between 1 and the model's {self.n_layers} layers")
        h = self.hidden_size
        layer_params = h * self.head_dim * (self.n_heads + 2 * self.n_kv_heads) + h * h + 3 * h * self.intermediate_size
        head = 0.5 * self.vocab_size * h / layer_params
        per_stage = (self.n_layers + head) / n_stages
        bounds = [min(self.n_layers - (n_stages - s), max(s, round(s * per_stage))) for s in range(n_stages)]
        bounds.append(self.n_layers)
        return range(bounds[stage], bounds[stage + 1])


# ---------------------------------------------------------------- metadata

def read_model_info(model_path: str = "") -> ModelInfo:
    path = resolve_model_path(model_path)
    return _hf_info(path) if path.is_dir() else _gguf_info(path)


def _gguf_fields(path: Path) -> tuple[object, dict[str, object]]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            continue  # the vocabulary is the tokenizer's business
        fields[name] = f.contents()
    return reader, fields


def _gguf_info(path: Path) -> ModelInfo:
    reader, f = _gguf_fields(path)
    arch = f["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} not supported (llama only)")
    n_heads = int(f["llama.attention.head_count"])
    eos = f.get("tokenizer.ggml.eos_token_id")
    # vocab size from the embedding tensor, whatever the metadata says
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return ModelInfo(
        path=str(path), arch="llama",
        vocab_size=int(emb.shape[-1]),
        hidden_size=int(f["llama.embedding_length"]),
        n_layers=int(f["llama.block_count"]),
        n_heads=n_heads,
        n_kv_heads=int(f.get("llama.attention.head_count_kv", n_heads)),
        intermediate_size=int(f["llama.feed_forward_length"]),
        norm_eps=float(f["llama.attention.layer_norm_rms_epsilon"]),
        context_length=int(f["llama.context_length"]),
        rope_theta=float(f.get("llama.rope.freq_base", 10000.0)),
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
    )


def _hf_info(path: Path) -> ModelInfo:
    c = json.loads((path / "config.json").read_text())
    eos = c.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    kind = c.get("model_type")
    if kind == "llama":
        if c.get("rope_scaling") or (c.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            raise ValueError(f"{path}: rope scaling is not supported")
        n_heads = c["num_attention_heads"]
        theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return ModelInfo(
            path=str(path), arch="llama", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            n_layers=c["num_hidden_layers"], n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads", n_heads),
            intermediate_size=c["intermediate_size"], norm_eps=c["rms_norm_eps"],
            context_length=c.get("max_position_embeddings", 2048), rope_theta=float(theta),
            tie_embeddings=c.get("tie_word_embeddings", False), bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    if kind == "gpt2":
        if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{path}: GPT-2 activation {c['activation_function']!r} not supported")
        return ModelInfo(
            path=str(path), arch="gpt2", vocab_size=c["vocab_size"], hidden_size=c["n_embd"],
            n_layers=c["n_layer"], n_heads=c["n_head"], n_kv_heads=c["n_head"],
            intermediate_size=c.get("n_inner") or 4 * c["n_embd"], norm_eps=c["layer_norm_epsilon"],
            context_length=c["n_positions"], tie_embeddings=True, bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    raise ValueError(f"{path}: model_type {kind!r} not supported (llama, gpt2)")


# ---------------------------------------------------------------- weights

@dataclass(slots=True)
class StageWeights:
    """The tensors one pipeline stage needs; names are the canonical ones the model reads."""

    layers: list[dict[str, Tensor]]
    embed: Tensor | None = None        # stage 0 (and the last stage when the LM head is tied)
    pos_embed: Tensor | None = None    # GPT-2, stage 0
    final_norm: dict[str, Tensor] | None = None
    lm_head: Tensor | None = None


def load_stage_weights(info: ModelInfo, layers: range, first: bool, last: bool, dtype: torch.dtype) -> StageWeights:
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
        from gguf import GGUFReader

        self.tensors = {t.name: t for t in GGUFReader(path).tensors}
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
