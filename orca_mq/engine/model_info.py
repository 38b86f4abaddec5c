"""What the model is (ModelInfo), read from a GGUF file's metadata or a Hugging Face config.json.

Torch-free, so the frontend and the scheduler can size and validate requests without the engine.
Parsing a GGUF's metadata walks its whole vocabulary (seconds); the result is cached per file
under `model.cache_dir`, so restarted processes come back fast.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_mq.engine.model_files import resolve_model_path

if TYPE_CHECKING:
    from orca_mq.config import Config


@dataclass(slots=True)
class ModelInfo:
    path: str
    arch: str                      # "llama" | "gpt2"
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    norm_eps: float
    context_length: int
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def max_model_len(self, cfg: "Config") -> int:
        return min(cfg.model.max_model_len, self.context_length)

    def stage_layers(self, stage: int, n_stages: int) -> range:
        """Contiguous inter-layer partition balancing work per stage. The last stage also runs the LM
        head (vocab x hidden per request and iteration), counted as layers' worth of parameters at
        half weight: a middle ground between decode-heavy iterations (head ~ every token) and
        prefill-heavy ones (head on one token of many)."""
        if not 1 <= n_stages <= self.n_layers:
            raise ValueError(f"n_workers={n_stages} must be between 1 and the model's {self.n_layers} layers")
        h = self.hidden_size
        layer_params = h * self.head_dim * (self.n_heads + 2 * self.n_kv_heads) + h * h + 3 * h * self.intermediate_size
        head = 0.5 * self.vocab_size * h / layer_params
        per_stage = (self.n_layers + head) / n_stages
        bounds = [min(self.n_layers - (n_stages - s), max(s, round(s * per_stage))) for s in range(n_stages)]
        bounds.append(self.n_layers)
        return range(bounds[stage], bounds[stage + 1])


def cache_key(path: Path, *parts: object) -> str:
    """A file's identity (path, size, mtime) and `parts`, hashed: a changed file misses the cache."""
    st = path.stat()
    return hashlib.sha1(repr((str(path.resolve()), st.st_size, st.st_mtime_ns, *parts)).encode()).hexdigest()[:20]


def read_model_info(model_path: str = "", cache_dir: str = "") -> ModelInfo:
    path = resolve_model_path(model_path)
    if path.is_dir():
        return _hf_info(path)
    cached = Path(cache_dir).expanduser() / f"info-{cache_key(path)}.json" if cache_dir else None
    if cached is not None and cached.exists():
        try:
            return ModelInfo(**json.loads(cached.read_text()))
        except (ValueError, TypeError):
            pass  # a stale or torn entry: parse again
    info = _gguf_info(path)
    if cached is not None:
        _write_atomic(cached, json.dumps(dataclasses.asdict(info)).encode())
    return info


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def gguf_reader(path: Path) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


def _gguf_info(path: Path) -> ModelInfo:
    try:
        reader = gguf_reader(path)
    except Exception as e:  # the gguf package raises ValueError, struct.error, IndexError... for a damaged file
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    f: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            continue  # the vocabulary is the tokenizer's business
        f[name] = fld.contents()
    try:
        return _gguf_fields(path, reader, f)
    except KeyError as e:
        raise ValueError(f"{path}: the GGUF metadata lacks the key {e.args[0]!r}") from None
    except StopIteration:
        raise ValueError(f"{path}: the GGUF file has no token_embd.weight tensor") from None


def _gguf_fields(path: Path, reader: Any, f: dict[str, Any]) -> ModelInfo:
    arch = f["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} not supported (llama only)")
    n_heads = int(f["llama.attention.head_count"])
    eos = f.get("tokenizer.ggml.eos_token_id")
    # vocab size from the embedding tensor, whatever the metadata says
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return ModelInfo(
        path=str(path), arch="llama",
        vocab_size=int(emb.shape[-1]),
        hidden_size=int(f["llama.embedding_length"]),
        n_layers=int(f["llama.block_count"]),
        n_heads=n_heads,
        n_kv_heads=int(f.get("llama.attention.head_count_kv", n_heads)),
        intermediate_size=int(f["llama.feed_forward_length"]),
        norm_eps=float(f["llama.attention.layer_norm_rms_epsilon"]),
        context_length=int(f["llama.context_length"]),
        rope_theta=float(f.get("llama.rope.freq_base", 10000.0)),
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
    )



def _hf_info(path: Path) -> ModelInfo:
    """config.json's fields; a missing one is a ValueError naming the file and the key."""
    file = path / "config.json"
    try:
        c = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(c, dict):
        raise ValueError(f"{file}: expected a JSON object")
    try:
        return _hf_fields(path, c)
    except KeyError as e:
        raise ValueError(f"{file} lacks the key {e.args[0]!r} (model_type {c.get('model_type')!r})") from None


def _hf_fields(path: Path, c: dict[str, Any]) -> ModelInfo:
    eos = c.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    kind = c.get("model_type")
    if kind == "llama":
        if c.get("rope_scaling") or (c.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            raise ValueError(f"{path}: rope scaling is not supported")
        n_heads = c["num_attention_heads"]
        theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return ModelInfo(
            path=str(path), arch="llama", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            n_layers=c["num_hidden_layers"], n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads", n_heads),
            intermediate_size=c["intermediate_size"], norm_eps=c["rms_norm_eps"],
            context_length=c.get("max_position_embeddings", 2048), rope_theta=float(theta),
            tie_embeddings=c.get("tie_word_embeddings", False), bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    if kind == "gpt2":
        if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{path}: GPT-2 activation {c['activation_function']!r} not supported")
        return ModelInfo(
            path=str(path), arch="gpt2", vocab_size=c["vocab_size"], hidden_size=c["n_embd"],
            n_layers=c["n_layer"], n_heads=c["n_head"], n_kv_heads=c["n_head"],
            intermediate_size=c.get("n_inner") or 4 * c["n_embd"], norm_eps=c["layer_norm_epsilon"],
            context_length=c["n_positions"], tie_embeddings=True, bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    raise ValueError(f"{path}: model_type {kind!r} not supported (llama, gpt2)")
