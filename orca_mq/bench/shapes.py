"""Published model shapes for tools/gpu_check.py --shape: each checkpoint's config.json as its publisher
ships it (the keys that set the shape; nothing is downloaded), written beside a tokenizer of its vocabulary
and random_weights.json, so that the engine draws the weights on the device at load
(orca_mq/models/random_weights.py) and serves them as it would the checkpoint's own.
"""
from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# meta-llama/Llama-3.2-1B, config.json on the Hugging Face hub: hidden 2048, 16 layers, 32 heads of 64
# over 8 KV heads, intermediate 8192, vocabulary 128256, llama3 rope scaling (factor 32 from 8192
# positions, theta 500000), the LM head tied to the embeddings
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
    "bos_token_id": 128000, "eos_token_id": 128001,
}
# meta-llama/Llama-3.1-8B, config.json: hidden 4096, 32 layers, 32 heads over 8 KV heads (head_dim
# 4096 / 32 = 128), intermediate 14336, vocabulary 128256, llama3 rope scaling (factor 8), an untied head
LLAMA_3_1_8B = LLAMA_3_2_1B | {
    "hidden_size": 4096, "num_hidden_layers": 32, "head_dim": 128, "intermediate_size": 14336,
    "rope_scaling": LLAMA_3_2_1B["rope_scaling"] | {"factor": 8.0}, "tie_word_embeddings": False,
}
# Qwen/Qwen3-8B, config.json: hidden 4096, 36 layers, 32 heads of 128 over 8 KV heads, intermediate
# 12288, vocabulary 151936, 40960 positions, rope theta 1e6 without scaling, no sliding window, an untied head
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
    "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "hidden_act": "silu",
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None,
    "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
}
# Qwen/Qwen3-30B-A3B, config.json: hidden 2048, 48 layers, 32 heads of 128 over 4 KV heads, every layer
# a mixture of 128 experts (top-8, each expert's intermediate 768, the top-8 weights renormalised:
# norm_topk_prob), vocabulary 151936, 40960 positions, rope theta 1e6, an untied head
QWEN3_30B_A3B = QWEN3_8B | {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "intermediate_size": 6144, "max_window_layers": 48,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False,
}
SHAPES: dict[str, dict[str, Any]] = {"llama-3.2-1b": LLAMA_3_2_1B, "llama-3.1-8b": LLAMA_3_1_8B, "qwen3-8b": QWEN3_8B,
                                     "qwen3-30b-a3b": QWEN3_30B_A3B}
# --small (a CPU plumbing run): the same families and options, narrow: 2 layers of hidden 64, heads grouped
# as the real ones (4 per KV head, 8 for the MoE), 8 experts of which top-2
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 16, "intermediate_size": 128,
         "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}
SMALL_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@dataclass(frozen=True, slots=True)
class ShapeRun:
    """What --shape asks: the shape, its layers (None: the published count), FP8 weights."""

    name: str
    layers: int | None = None
    fp8: bool = False

    def config(self, small: bool) -> dict[str, Any]:
        cfg = copy.deepcopy(SHAPES[self.name])
        if small:
            cfg |= SMALL | {"num_key_value_heads": 8 * cfg["num_key_value_heads"] // cfg["num_attention_heads"]}
            cfg |= SMALL_MOE if "num_experts" in cfg else {}
        if self.layers is not None:
            cfg["num_hidden_layers"] = self.layers
        if "max_window_layers" in cfg:   # Qwen's: every layer (none slides: use_sliding_window is false)
            cfg["max_window_layers"] = cfg["num_hidden_layers"]
        return cfg

    def directory(self, root: Path, small: bool) -> Path:
        """The checkpoint directory (config.json, tokenizer, random_weights.json), written once under `root`."""
        cfg = self.config(small)
        path = root / f"{self.name}-{cfg['num_hidden_layers']}l{'-small' * small}"
        if (path / "config.json").exists() and json.loads((path / "config.json").read_text()) == cfg:
            return path
        from orca_mq.bench.random_models import save_byte_tokenizer
        from orca_mq.models.random_weights import RandomWeights

        path.mkdir(parents=True, exist_ok=True)
        eos = cfg["eos_token_id"]
        save_byte_tokenizer(path, cfg["bos_token_id"], eos if isinstance(eos, int) else eos[0], cfg["vocab_size"])
        RandomWeights().save(path)
        (path / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")   # last: a torn write is rewritten
        return path

    def argv(self) -> list[str]:
        """The options that give a section process the same run."""
        return ["--shape", self.name] + ["--layers", str(self.layers)] * (self.layers is not None) + ["--fp8"] * self.fp8

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ShapeRun | None":
        return cls(args.shape, args.layers, args.fp8) if args.shape else None


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shape", choices=SHAPES, default=None, help="a published model's shape with random weights made "
                    "on the device: its own sections (decode and prefill beside their floors, offline and served bursts)")
    ap.add_argument("--layers", type=_positive, default=None, metavar="N",
                    help="--shape with N layers (default: the published count)")
    ap.add_argument("--fp8", action="store_true", help="--shape with model.quantization = fp8")


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a layer count >= 1, got {n}")
    return n
