"""The model's tokenizer as the serving processes use it: the Rust `tokenizers` tokenizer exactly as
transformers configures it from the checkpoint, its chat template(s) and the named special tokens the
template reads, with no transformers in the process.

transformers is the reference (no hand-written BPE): it loads the checkpoint's tokenizer once (a
GGUF's vocabulary converted, 12 s for the embedded model's; a directory's through the class its
tokenizer_config.json names), and what it made is kept under `model.cache_dir`: its Rust tokenizer as
JSON (the post-processor that adds BOS, the added tokens) and the template beside. Every later process
loads that in ~0.1 s, where importing transformers alone costs 1.5-2 s of CPU: the frontend, the HTTP
API and the scheduler (grammars' vocabulary) start without it. A directory's entry is keyed by the
contents of its files but the weights and the model's own config (checkpoints that share a tokenizer
share it), a GGUF's by the file's identity; both by transformers' and tokenizers' versions. Templates
render through orca_mq.chat_template.
"""
from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from orca_mq.chat_template import render
from orca_mq.models.files import cache_key, contents_key, resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMAT = 2   # what a cached entry holds: bump when it changes
# a directory's files that are not the tokenizer's: out of its entry's key (of config.json, the two keys
# transformers reads to pick a tokenizer class are in it)
NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".index.json", "config.json",
                 "generation_config.json", "random_weights.json")
LARGEST_TOKENIZER_FILE = 256 << 20   # a larger file is weights of some kind (Gemma 3's tokenizer.json: 33 MB)


@dataclass(slots=True)
class Tokenizer:
    backend: RustTokenizer                        # transformers' configured Rust tokenizer, without padding or truncation
    chat_template: str | dict[str, str] | None    # one template, or named ones ("default", "tool_use")
    special_tokens: dict[str, str]                # bos_token, eos_token, unk_token, pad_token: what the template reads

    @classmethod
    def of(cls, hf: PreTrainedTokenizerBase) -> "Tokenizer":
        backend = copy.copy(hf.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return cls.made(backend.to_str(), hf.chat_template, dict(hf.special_tokens_map),
                        hf.backend_tokenizer.encode_special_tokens)

    @classmethod
    def load(cls, folder: Path) -> "Tokenizer":
        meta = json.loads((folder / "meta.json").read_text())
        return cls.made((folder / "tokenizer.json").read_text(), meta["chat_template"], meta["special_tokens"],
                        meta["split_special_tokens"])

    @classmethod
    def made(cls, text: str, template: str | dict[str, str] | None, specials: dict[str, str], split: bool) -> "Tokenizer":
        """`split`: transformers' split_special_tokens, a setting of the Rust tokenizer its JSON leaves out
        (special tokens in a prompt's text are then text, as the checkpoint asks)."""
        backend = RustTokenizer.from_str(text)
        backend.encode_special_tokens = split
        return cls(backend, template, specials)

    def save(self, folder: Path) -> None:
        (folder / "tokenizer.json").write_text(self.backend.to_str())
        (folder / "meta.json").write_text(json.dumps({"chat_template": self.chat_template, "special_tokens": self.special_tokens,
                                                      "split_special_tokens": self.backend.encode_special_tokens}))

    def __repr__(self) -> str:   # not the vocabulary's JSON
        return f"Tokenizer({len(self)} tokens, specials {self.special_tokens})"

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.backend.token_to_id(bos)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend.get_added_tokens_decoder()

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, t in self.added_tokens_decoder.items() if t.special)

    def json(self) -> str:
        """The Rust tokenizer as JSON (llguidance builds its vocabulary from it)."""
        return self.backend.to_str()

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Through encode_batch, which releases the GIL (encode holds it for the whole call): a long prompt on
        a thread leaves the event loop running."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` as the decoder makes it, without transformers' clean-up of spaces (which it skips for BPE)."""
        return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = False, /, **kwargs: Any) -> str:
        """The conversation in the model's chat template (= transformers' apply_chat_template(tokenize=False))."""
        if self.chat_template is None:
            raise ValueError("the model's tokenizer has no chat template")
        return render(self.chat_template, messages, tools, add_generation_prompt, self.special_tokens, **kwargs)


def load_tokenizer(model_path: str = "", cache_dir: str | None = None) -> Tokenizer:
    """The model's tokenizer, from the entry under `cache_dir` (config.toml's model.cache_dir when not given,
    "" for none), made through transformers where there is none."""
    path = resolve_model_path(model_path)
    cache_dir = _cache_dir(cache_dir)
    entry = Path(cache_dir).expanduser() / "tokenizers" / f"served-{_key(path)}" if cache_dir else None
    if entry is not None and entry.exists():
        try:
            return Tokenizer.load(entry)
        except Exception:   # a damaged entry: made again below, in its place
            shutil.rmtree(entry, ignore_errors=True)
    tok = Tokenizer.of(hf_tokenizer(str(path), cache_dir))
    if entry is not None:
        _save_atomic(entry, tok.save)
    return tok


def hf_tokenizer(model_path: str = "", cache_dir: str | None = None) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of the model (to save beside a checkpoint, or as the reference); a GGUF's
    converted once and kept under `cache_dir`."""
    path = resolve_model_path(model_path)
    if path.is_dir():
        return load_saved(path)
    cache_dir = _cache_dir(cache_dir)
    cache = Path(cache_dir).expanduser() / "tokenizers" / cache_key(path) if cache_dir else None
    if cache is not None and (cache / "tokenizer_config.json").exists():
        return load_saved(cache)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if cache is not None:
        _save_atomic(cache, tok.save_pretrained)
    return tok


def load_saved(folder: Path) -> PreTrainedTokenizerBase:
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


def _cache_dir(cache_dir: str | None) -> str:
    if cache_dir is not None:
        return cache_dir
    from orca_mq.config import load_config

    return load_config().model.cache_dir


def _key(path: Path) -> str:
    """A GGUF's identity; a directory's files but the weights by content (those transformers reads for a
    tokenizer, its additional_chat_templates/ too), with config.json's model_type and tokenizer_class."""
    made_by = (FORMAT, importlib.metadata.version("transformers"), importlib.metadata.version("tokenizers"))
    if path.is_file():
        return cache_key(path, *made_by)
    try:
        conf = json.loads((path / "config.json").read_text())
        picks = (conf.get("model_type"), conf.get("tokenizer_class"))
    except (OSError, ValueError, AttributeError):
        picks = None
    files = sorted(f for f in path.iterdir() if not f.name.endswith(NOT_TOKENIZER))
    files += sorted((path / "additional_chat_templates").glob("*"))
    return contents_key(path, [f for f in files if f.is_file() and f.stat().st_size <= LARGEST_TOKENIZER_FILE],
                        made_by, picks)


def _save_atomic(dest: Path, save: Any) -> None:
    """Written into a folder of this call's own beside, then renamed into place: processes that start together
    never read a half-written one. Any failure (another's copy is there, a read-only or full disk) costs only
    the time to make it again: the caller has its tokenizer."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    except OSError:
        return
    try:
        save(tmp)
        os.rename(tmp, dest)
    except Exception:   # tokenizers' own save raises a bare Exception (a full disk too)
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
