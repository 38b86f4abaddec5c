"""Random-weight Hugging Face models saved as safetensors directories: the tests' tiny models, the
control-plane benchmark's narrow one (compute negligible), and the GPU check's models of the embedded
model's exact shape (its 93 MB GGUF does not travel to the device machine; its tokenizer and
config.json do)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_random_model(path: Path, config: Any, near_ties: bool = False) -> Path:
    """Seeded random weights for `config`. `near_ties`: token 2i+1's LM-head row is token 2i's within
    1e-6, so greedy picks between them by rounding (a probe for anything that changes the logits)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # random init is near-zero for some params; widen so bugs change logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        if near_ties:
            w = model.lm_head.weight
            n = w.shape[0] // 2 * 2
            w[1:n:2] = w[0:n:2] * (1 + 1e-6 * torch.randn_like(w[0:n:2]))
    model.save_pretrained(path, safe_serialization=True)
    return path


def random_llama(path: Path, *, layers: int, max_positions: int, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 128, near_ties: bool = False) -> Path:
    """A random Llama with the embedded model's tokenizer and chat template, so that it serves real text."""
    from transformers import LlamaConfig

    from orca_mq.tokenizer import load_tokenizer

    tok = load_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      rms_norm_eps=1e-5, tie_word_embeddings=not near_ties, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    save_random_model(path, cfg, near_ties)
    tok.save_pretrained(path)
    return path


def check_models(src: Path, out: Path, small: bool = False) -> dict[str, Path]:
    """From a tokenizer + config.json directory: `smol` (its shape, a tied head like the real model) and
    `smol_tie` (untied, LM-head rows in near-tied pairs). `small`: 2 layers of hidden 128 (CPU runs)."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    made = {}
    for name, near_ties in (("smol", False), ("smol_tie", True)):
        cfg = AutoConfig.from_pretrained(src)
        cfg.tie_word_embeddings = not near_ties
        if small:
            cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 2, 128, 256
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 32
        save_random_model(out / name, cfg, near_ties)
        tok.save_pretrained(out / name)
        made[name] = out / name
    return made
