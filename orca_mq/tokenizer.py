"""Tokenizer and chat template from the model file, through transformers (no hand-written BPE).

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is cached under
`model.cache_dir`, keyed by the GGUF file's identity.
"""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orca_mq.models.files import resolve_model_path
from orca_mq.models.files import cache_key


def load_tokenizer(model_path: str = "", cache_dir: str = "") -> PreTrainedTokenizerBase:
    path = resolve_model_path(model_path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    cache = Path(cache_dir).expanduser() / "tokenizers" / cache_key(path) if cache_dir else None
    if cache is not None and (cache / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if cache is not None:
        try:
            tok.save_pretrained(cache)
        except OSError:
            pass  # a read-only cache only costs the conversion time again
    return tok
