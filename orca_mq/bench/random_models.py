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

    from orca_mq.tokenizer import hf_tokenizer

    tok = hf_tokenizer()
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


# Tiny checkpoints of every family (random weights, transformers' own config classes): windows of 16 so
# that a test's prompts run past them, heads that group (4 over 2), head_dim apart from hidden / heads.
WINDOW = 16
FAMILIES = ("llama", "llama3_rope", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe",
            "gpt_oss")
LENGTH_ROPES = ("llama_dynamic", "phi3_longrope")   # rotaries whose tables follow the sequence's length


def save_byte_tokenizer(path: Path, bos: int = 1, eos: int = 2, size: int = 256) -> Path:
    """A byte-level tokenizer of `size` tokens saved in `path`: token i < 256 is byte i (no merges: text
    encodes to bytes), a token past them reads "<i>" (a random model's vocabulary of a real size, every
    id it samples decodable). bos and eos are tokens of it, as the config names them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()   # byte -> the printable character byte-level BPE spells it with
    spell = [chars[b] for b in range(256)] + [f"<{i}>" for i in range(256, size)]
    tok = Tokenizer(models.BPE({s: i for i, s in enumerate(spell)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spell[bos], eos_token=spell[eos]).save_pretrained(path)
    return path


def family_config(name: str, vocab_size: int = 256, layers: int = 4, **extra: Any) -> Any:
    """A transformers config of family `name` (FAMILIES), tiny, with every option that sets it apart on
    (`extra` overrides any of them)."""
    import transformers as t

    c = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)
    w, alternate = WINDOW, ["sliding_attention", "full_attention"] * (layers // 2)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
    cls, options = {
        "llama": (t.LlamaConfig, dict(head_dim=24, attention_bias=True)),
        "llama3_rope": (t.LlamaConfig, dict(rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})),
        "qwen2": (t.Qwen2Config, dict(tie_word_embeddings=True, rope_parameters=yarn)),
        "qwen3": (t.Qwen3Config, dict(head_dim=24)),
        "mistral": (t.MistralConfig, dict(sliding_window=w, head_dim=16)),
        "gemma2": (t.Gemma2Config, dict(head_dim=16, sliding_window=w, query_pre_attn_scalar=24,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
        "gemma3": (t.Gemma3TextConfig, dict(head_dim=16, sliding_window=w, layer_types=alternate, query_pre_attn_scalar=16)),
        "phi3": (t.Phi3Config, dict(partial_rotary_factor=0.5, sliding_window=w)),
        "phi3_longrope": (t.Phi3Config, dict(partial_rotary_factor=0.75, original_max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(6)],
            "long_factor": [2.0 + 0.5 * i for i in range(6)]})),
        "llama_dynamic": (t.LlamaConfig, dict(max_position_embeddings=32, rope_parameters={
            "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})),
        "mixtral": (t.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=w)),
        "qwen3_moe": (t.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             norm_topk_prob=True, mlp_only_layers=[1])),
        "gpt_oss": (t.GptOssConfig, dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=w,
                                         layer_types=alternate, rope_parameters=yarn | {
                                             "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})),
    }[name]
    return cls(**c | options | extra)
