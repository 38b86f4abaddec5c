"""A checkpoint checked against its config before any worker starts, once: the check (models/weights.py
check_tensors) imports torch and the family code and opens every file, 2-3 s of each start that the
launcher would pay again for a checkpoint it has seen; a sound one is remembered under model.cache_dir,
keyed by its files and this package's code, so a changed file or a new orca-mq checks again."""
from __future__ import annotations

from pathlib import Path

from orca_mq.models.info import ModelInfo
from orca_mq.models.registry import files_identity


def check_checkpoint(info: ModelInfo, cache_dir: str = "") -> None:
    """A ValueError naming the file and the tensor where the checkpoint disagrees with its config."""
    done = _marker(Path(info.path), cache_dir)
    if done is not None and done.exists():
        return
    from orca_mq.models.weights import check_tensors

    check_tensors(info)
    if done is not None:
        done.parent.mkdir(parents=True, exist_ok=True)
        done.touch()


def _marker(path: Path, cache_dir: str) -> Path | None:
    files = sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else [path]
    if not cache_dir or not files:
        return None
    return Path(cache_dir).expanduser() / f"checked-{files_identity(files)}"
