"""The families orca-mq serves, keyed by what a checkpoint calls itself: config.json's `model_type` /
`architectures` (a Hugging Face directory) or `general.architecture` (a GGUF file).

A family (one file of this package each) says how to read its options from a config (`from_hf`,
`from_gguf`), where its tensors are in each kind of checkpoint (`names`), and how to bring them to
the canonical layout the layer code reads (`convert`). `read_model_info` is the one way in.
"""
from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_mq.models.files import cache_key, contents_key, resolve_model_path, write_atomic
from orca_mq.models.info import ModelInfo

if TYPE_CHECKING:
    import torch

    from orca_mq.models.gguf_meta import GGUFMeta
    from orca_mq.models.names import Names

FAMILY_MODULES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe",
                  "gpt_oss", "gpt2")


@dataclass(frozen=True, slots=True)
class Family:
    name: str                                        # ModelInfo.arch
    hf_types: tuple[str, ...]                        # config.json model_type values it reads
    required: tuple[str, ...]                        # config.json keys it cannot do without ("a|b": either)
    from_hf: Callable[[Any, Path], ModelInfo]        # (transformers' config object, the directory)
    names: Callable[[ModelInfo, bool], "Names"]      # where its tensors are (gguf=True: llama.cpp's names)
    gguf_arch: str | None = None                     # general.architecture, where llama.cpp has the family
    from_gguf: Callable[["GGUFMeta"], ModelInfo] | None = None
    convert: Callable[[ModelInfo, dict[str, "torch.Tensor"], bool], dict[str, "torch.Tensor"]] | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def _load() -> None:
    if not FAMILIES:
        for name in FAMILY_MODULES:
            importlib.import_module(f"orca_mq.models.{name}")


def family(arch: str) -> Family:
    _load()
    return FAMILIES[arch]


def by_hf_type(model_type: str) -> Family | None:
    _load()
    return next((f for f in FAMILIES.values() if model_type in f.hf_types), None)


def by_gguf_arch(arch: str) -> Family | None:
    _load()
    return next((f for f in FAMILIES.values() if f.gguf_arch == arch), None)


def supported() -> str:
    _load()
    return ", ".join(sorted({t for f in FAMILIES.values() for t in f.hf_types}))


# ---------------------------------------------------------------- reading a checkpoint

def read_model_info(model_path: str = "", cache_dir: str = "") -> ModelInfo:
    """The model's ModelInfo; a ValueError naming the file and what is wrong when it cannot be served.
    Cached under `cache_dir` by what it is read from and this package's code: a GGUF's metadata takes
    seconds to parse, and transformers' config reading imports torch (seconds of start-up in the
    launcher and in the processes that need none: the frontend, the scheduler)."""
    path = resolve_model_path(model_path)
    cached = Path(cache_dir).expanduser() / f"info3-{_identity(path)}.json" if cache_dir else None
    if cached is not None and cached.exists():
        try:
            info = ModelInfo.from_json(json.loads(cached.read_text()))
            info.path = str(path)   # a directory's entry may be another's with the same config
            return info
        except (ValueError, TypeError, KeyError):
            pass  # a stale or torn entry: parse again
    if path.is_dir():
        info = _hf_info(path)
    else:
        from orca_mq.models.gguf_meta import gguf_info

        info = gguf_info(path)
    if cached is not None:
        write_atomic(cached, json.dumps(info.to_json()).encode())
    return info


def _identity(path: Path) -> str:
    """What a ModelInfo is read from and the code that reads it (this package's files): a GGUF file by
    its identity; a directory by the contents of config.json and generation_config.json, all a
    directory's info depends on but its path (checkpoints of one config, a test's fresh ones, share it)."""
    if path.is_file():
        return files_identity([path])
    return contents_key(path, [path / "config.json", path / "generation_config.json"], code_identity())


def files_identity(files: list[Path]) -> str:
    """A key of these files (path, size, time) and of this package's code, for what is cached from them."""
    return cache_key(files[0], *map(cache_key, files[1:]), code_identity())


@functools.cache
def code_identity() -> tuple[tuple[str, int, int], ...]:
    """This package's files (name, size, time): what is cached from a checkpoint misses when the code changes."""
    return tuple(sorted((f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in Path(__file__).parent.rglob("*.py")))


def _hf_info(path: Path) -> ModelInfo:
    """config.json read by transformers (which fills each family's defaults and names its rope scaling
    one way); keys the family needs checked first, since transformers would fill them with defaults."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object")
    kind = raw.get("model_type")
    fam = by_hf_type(kind) if isinstance(kind, str) else None
    if fam is None:
        archs = raw.get("architectures")
        raise ValueError(f"{file}: model_type {kind!r}{f' ({archs[0]})' if isinstance(archs, list) and archs else ''} "
                         f"not supported (supported: {supported()})")
    if missing := [k for k in fam.required if not any(a in raw for a in k.split("|"))]:
        raise ValueError(f"{file} lacks the key {missing[0].split('|')[0]!r} (model_type {kind!r})")
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{file}: transformers cannot read this {kind} config ({e})") from None
    try:
        info = fam.from_hf(cfg, path)
    except (KeyError, AttributeError) as e:
        raise ValueError(f"{file} lacks the key {e.args[0]!r} (model_type {kind!r})") from None
    info.eos_token_ids = _eos_ids(cfg.eos_token_id, path)
    return info


def _eos_ids(config_eos: int | list[int] | None, path: Path) -> list[int]:
    """Every end-of-turn id the checkpoint declares: config.json's and generation_config.json's (a list in
    chat checkpoints: Llama 3's <|end_of_text|> and <|eot_id|>, Qwen's <|endoftext|> and <|im_end|>)."""
    ids: list[int] = []
    sources: list[Any] = [config_eos]
    gen = path / "generation_config.json"
    if gen.exists():
        try:
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        except (ValueError, AttributeError):
            raise ValueError(f"{gen}: not a JSON object") from None
    for s in sources:
        for i in ([s] if isinstance(s, int) else s if isinstance(s, list) else []):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def supported_gguf() -> str:
    _load()
    return ", ".join(sorted(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch and f.from_gguf))
