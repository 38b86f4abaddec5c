"""A Hugging Face checkpoint written as llama.cpp's convert_hf_to_gguf.py writes it, for the GGUF tests:
its architecture name and metadata keys, the gguf package's own tensor-name map (gguf.TensorNameMap),
Llama's Q/K rows permuted for llama.cpp's rotary, Gemma's norms stored as 1 + w, experts stacked into
one tensor per projection, Phi-3's fused tensors kept fused. transformers' own GGUF reader loads what
this writes back into the same model (checked in tests/test_gguf_families.py), so the writer's
conventions are llama.cpp's and not just this project's.

`qtype` quantizes the 2-D weight matrices (the gguf package quantizes F16, BF16, Q8_0, Q4_0 and Q4_1;
for the K types, which it only dequantizes, `random_k` writes random blocks with sane scales instead).
"""
from __future__ import annotations

import zlib
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "mixtral": gguf.MODEL_ARCH.LLAMA,
        "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
        "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}
K_TYPES = {gguf.GGMLQuantizationType.Q4_K: (144, (0, 2)), gguf.GGMLQuantizationType.Q5_K: (176, (0, 2)),
           gguf.GGMLQuantizationType.Q6_K: (210, (208,))}   # block bytes, offsets of its fp16 scales


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: rotate-half pairs -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random K-quant blocks for a [rows, cols] tensor (cols a multiple of 256) whose fp16 scales are small."""
    size, scales = K_TYPES[qtype]
    rows, cols = shape
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in scales:
        data[..., at:at + 2] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def write_gguf(src: Path, out: Path, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    cfg = AutoConfig.from_pretrained(src)
    kind = cfg.model_type
    arch = ARCH[kind]
    n_layers, heads, kv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    params = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(params["rope_theta"])
    rot = int(head_dim * params.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rot)
    kind_rope = params.get("rope_type", "default")
    if kind_rope in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(kind_rope))
        w.add_rope_scaling_factor(params["factor"])
        if kind_rope == "yarn":
            w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    if kind_rope == "llama3":   # llama.cpp's rope_freqs: a divisor per frequency, from the llama3 parameters
        from orca_mq.models.info import RopeSpec
        from orca_mq.models.layers.rotary import inv_freq

        plain = inv_freq(RopeSpec("default", params["rope_theta"]), rot)[0]
        w.add_tensor("rope_freqs.weight", (plain / inv_freq(RopeSpec("llama3", params["rope_theta"], params), rot)[0]).numpy())
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if kind == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if kind == "gemma3_text":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_float32(f"{gguf.MODEL_ARCH_NAMES[arch]}.rope.freq_base_swa", cfg.rope_parameters["sliding_attention"]["rope_theta"])
    experts = getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if kind == "qwen3_moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)

    names = gguf.get_tensor_name_map(arch, n_layers)
    tensors = load_file(str(src / "model.safetensors"))
    stacked: dict[str, list[torch.Tensor]] = {}
    for hf_name, t in tensors.items():
        t = t.float()
        if arch is gguf.MODEL_ARCH.LLAMA and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _permute(t, heads)
        elif arch is gguf.MODEL_ARCH.LLAMA and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            t = _permute(t, kv)
        if kind in ("gemma2", "gemma3_text") and hf_name.endswith("norm.weight"):
            t = t + 1
        if ".experts." in hf_name:   # one [E, out, in] tensor per projection, as llama.cpp stacks them
            layer, e, proj = hf_name.split(".layers.")[1].split(".")[0], int(hf_name.split(".experts.")[1].split(".")[0]), hf_name.rsplit(".", 2)[-2]
            stacked.setdefault(f"{layer}.{proj}", [None] * experts)[e] = t   # type: ignore[list-item]
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        _add(w, name, t, qtype)
    proj_name = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps", "gate_proj": "ffn_gate_exps",
                 "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
    for key, parts in stacked.items():
        layer, proj = key.split(".")
        _add(w, f"blk.{layer}.{proj_name[proj]}.weight", torch.stack(parts), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add(w: gguf.GGUFWriter, name: str, t: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> None:
    data = t.numpy()
    if t.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32 or "norm" in name:
        w.add_tensor(name, data.astype(np.float32))
    elif qtype in K_TYPES:
        w.add_tensor(name, random_k(data.shape, qtype, zlib.crc32(name.encode())), raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
