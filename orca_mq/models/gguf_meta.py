"""A GGUF file's metadata (llama.cpp's keys, `{arch}.` prefixed) -> ModelInfo through its family.

Parsing a GGUF's metadata walks its whole vocabulary (seconds): models/registry.py caches the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orca_mq.models.info import ModelInfo, RopeSpec

MISSING = object()


def gguf_reader(path: Path) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


@dataclass(slots=True)
class GGUFMeta:
    path: Path
    arch: str
    fields: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]   # tensor name -> shape ([rows, cols] order)
    reader: Any = None

    def tensor(self, name: str) -> list[float]:
        """A small float tensor's values (rope factors)."""
        t = next(t for t in self.reader.tensors if t.name == name)
        return [float(x) for x in t.data.reshape(-1)]

    def get(self, key: str, default: Any = MISSING) -> Any:
        """`{arch}.key` (or a general key as is); KeyError naming it when missing and no default."""
        name = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        if name in self.fields:
            return self.fields[name]
        if default is MISSING:
            raise KeyError(name)
        return default

    def info(self, family: str, **options: Any) -> ModelInfo:
        """The keys every llama.cpp decoder writes alike; the family's own as `options`."""
        heads = int(self.get("attention.head_count"))
        head_dim = int(self.get("attention.key_length", 0)) or int(self.get("embedding_length")) // heads
        # every end-of-turn id the file declares: its EOS, and llama.cpp's end-of-turn / end-of-message ids
        eos = [int(i) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
               if (i := self.get(f"tokenizer.ggml.{k}", None)) is not None]
        rot = int(self.get("rope.dimension_count", head_dim))
        window = int(self.get("attention.sliding_window", 0) or 0)
        options.setdefault("rope", RopeSpec("default", float(self.get("rope.freq_base", 10000.0))))
        options.setdefault("qkv_bias", "blk.0.attn_q.bias" in self.shapes or "blk.0.attn_qkv.bias" in self.shapes)
        options.setdefault("o_bias", "blk.0.attn_output.bias" in self.shapes)
        return ModelInfo(
            path=str(self.path), arch=family, vocab_size=self.shapes["token_embd.weight"][0],
            hidden_size=int(self.get("embedding_length")), n_layers=int(self.get("block_count")), n_heads=heads,
            n_kv_heads=int(self.get("attention.head_count_kv", heads)),
            intermediate_size=int(self.get("feed_forward_length", 0) or 0),
            norm_eps=float(self.get("attention.layer_norm_rms_epsilon")), context_length=int(self.get("context_length")),
            head_dim=head_dim, rotary_dim=rot if rot < head_dim else 0,
            sliding_window=window, tie_embeddings="output.weight" not in self.shapes,
            bos_token_id=self.get("tokenizer.ggml.bos_token_id", None), eos_token_ids=list(dict.fromkeys(eos)),
            **options)


def gguf_info(path: Path) -> ModelInfo:
    from orca_mq.models.registry import by_gguf_arch, supported_gguf

    try:
        reader = gguf_reader(path)
    except Exception as e:  # the gguf package raises ValueError, struct.error, IndexError... for a damaged file
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    fields: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and not name.endswith("_token_id"):
            continue  # the vocabulary is the tokenizer's business
        fields[name] = fld.contents()
    arch = fields.get("general.architecture")
    fam = by_gguf_arch(arch) if isinstance(arch, str) else None
    if fam is None or fam.from_gguf is None:
        raise ValueError(f"{path}: GGUF architecture {arch!r} not supported (supported: {supported_gguf()})")
    shapes = {t.name: tuple(reversed([int(d) for d in t.shape])) for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: the GGUF file has no token_embd.weight tensor")
    try:
        return fam.from_gguf(GGUFMeta(path, arch, fields, shapes, reader))
    except KeyError as e:
        raise ValueError(f"{path}: the GGUF metadata lacks the key {e.args[0]!r}") from None
