"""Tokenizer and chat template from the model file, through transformers (no hand-written BPE).

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is cached next to
the user's cache dir, keyed by the GGUF file's size and mtime.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orca_mq.engine.model_files import resolve_model_path


def _cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("ORCA_MQ_CACHE", Path.home() / ".cache" / "orca_mq"))
    return root / "tokenizers" / key


def load_tokenizer(model_path: str = "") -> PreTrainedTokenizerBase:
    path = resolve_model_path(model_path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    cache = _cache_dir(path)
    if (cache / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        tok.save_pretrained(cache)
    except OSError:
        pass  # a read-only home only costs the conversion time again
    return tok
