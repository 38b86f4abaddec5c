"""Tiny random checkpoints of the model families, one per tool-call format, that a real server serves:
a transformers config of the family (Qwen3, Llama, Mistral, gpt-oss), random weights, and a tokenizer
carrying the family's real chat template (tests/data/chat_templates) and its markers as tokens, special
where the family's own vocabulary has them special (Qwen's <tool_call> and <think> are plain added tokens,
as in Qwen's tokenizer; Llama's, Mistral's and harmony's markers are special tokens).

Random weights write random text: a test forces what it needs (a tool call by tool_choice's grammar,
an answer by logit_bias), and reads the rest as whatever the parser makes of it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from orca_mq.bench.random_models import save_random_model
from template_families import FAMILIES, TOOLS

SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "tie_word_embeddings": False}


@dataclass(frozen=True)
class Served:
    template: str                 # tests/data/chat_templates' stem
    config: str                   # transformers' config class
    tool_parser: str              # what the server must find
    plain: tuple[str, ...] = ()   # markers that are plain added tokens (not special)
    eos: tuple[str, ...] = ()     # end tokens beyond the family's EOS
    extra: tuple[tuple[str, Any], ...] = ()


SERVED = {
    "hermes": Served("qwen3", "Qwen3Config", "hermes", plain=("<tool_call>", "</tool_call>", "<think>", "</think>")),
    "llama3_json": Served("llama3.2-instruct", "LlamaConfig", "llama3_json", eos=("<|eom_id|>",)),
    "mistral": Served("mistral-nemo-instruct-2407", "MistralConfig", "mistral"),
    "gpt_oss": Served("gpt-oss", "GptOssConfig", "gpt_oss", eos=("<|return|>",),
                      extra=(("num_local_experts", 4), ("num_experts_per_tok", 2), ("sliding_window", 64),
                             ("layer_types", ["sliding_attention", "full_attention"]))),
}


def tokenizer(served: Served) -> PreTrainedTokenizerFast:
    fam = FAMILIES[served.template]
    specials = [t for t in fam.specials if t not in served.plain]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [fam.text, json.dumps(TOOLS), "The weather in Paris is sunny. It is 18 degrees."]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in served.plain])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=fam.bos, eos_token=fam.eos, chat_template=fam.text)


def build(path: Path, fmt: str) -> Path:
    """A servable checkpoint of the family that speaks tool format `fmt`."""
    import transformers

    served = SERVED[fmt]
    tok = tokenizer(served)
    eos = [tok.convert_tokens_to_ids(t) for t in (FAMILIES[served.template].eos, *served.eos)]
    cfg = getattr(transformers, served.config)(**SHAPE, **dict(served.extra), vocab_size=len(tok),
                                               bos_token_id=tok.bos_token_id, eos_token_id=eos)
    save_random_model(path, cfg)
    tok.save_pretrained(path)
    return path
