"""Tokenizer and chat template from the model file, through transformers (no hand-written BPE).

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is cached under
`model.cache_dir`, keyed by the GGUF file's identity.

A saved tokenizer is loaded through the class its tokenizer_config.json names, imported alone:
AutoTokenizer's import pulls in torch (transformers' configuration module), 2-3 s of CPU at the start
of each process that only tokenizes (the frontend, the scheduler), and the memory torch holds.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from orca_mq.models.files import cache_key, resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_path: str = "", cache_dir: str | None = None) -> "PreTrainedTokenizerBase":
    """The model's tokenizer; a GGUF's converted once (12 s for the embedded model's) and kept under
    `cache_dir`: config.toml's model.cache_dir when not given, "" for none."""
    path = resolve_model_path(model_path)
    if path.is_dir():
        return load_saved(path)
    if cache_dir is None:
        from orca_mq.config import load_config

        cache_dir = load_config().model.cache_dir
    cache = Path(cache_dir).expanduser() / "tokenizers" / cache_key(path) if cache_dir else None
    if cache is not None and (cache / "tokenizer_config.json").exists():
        return load_saved(cache)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if cache is not None:
        _save_atomic(tok, cache)
    return tok


def _save_atomic(tok: "PreTrainedTokenizerBase", cache: Path) -> None:
    """Saved beside, then renamed into place: processes that start together never read a half-written one."""
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        tok.save_pretrained(tmp)
        os.rename(tmp, cache)
    except OSError:
        pass  # another process's copy is there, or the cache is read-only: only the conversion time again
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_saved(folder: Path) -> "PreTrainedTokenizerBase":
    """A saved tokenizer: the class its tokenizer_config.json names (the one AutoTokenizer would pick);
    AutoTokenizer itself where the file names none or one this transformers lacks."""
    import transformers

    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    cls = getattr(transformers, named, None) if isinstance(named, str) and named.isidentifier() else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(folder)
