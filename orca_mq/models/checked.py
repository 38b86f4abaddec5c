"""A checkpoint checked against its config before any worker starts: every tensor the config implies
is in it, of a type that can be read, with as many elements as the config implies (shapes only, from
the files' headers: no tensor is read and torch is not imported, so the launcher's check costs a fresh
checkpoint a fraction of a second). A sound one is remembered under model.cache_dir, keyed by its files
and this package's code, so a changed file or a new orca-mq checks again.
"""
from __future__ import annotations

import math
from pathlib import Path

from orca_mq.models.info import ModelInfo
from orca_mq.models.names import expected_shapes, names_of
from orca_mq.models.random_weights import random_weights
from orca_mq.models.registry import files_identity
from orca_mq.models.sources import open_source


def check_checkpoint(info: ModelInfo, cache_dir: str = "") -> None:
    """A ValueError naming the file and the tensor where the checkpoint disagrees with its config."""
    done = _marker(Path(info.path), cache_dir)
    if done is not None and done.exists():
        return
    check_tensors(info)
    if done is not None:
        done.parent.mkdir(parents=True, exist_ok=True)
        done.touch()


def _marker(path: Path, cache_dir: str) -> Path | None:
    files = sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else [path]
    if not cache_dir or not files:
        return None
    return Path(cache_dir).expanduser() / f"checked-{files_identity(files)}"


def check_tensors(info: ModelInfo) -> None:
    """Every tensor the config implies is in the checkpoint, of a type that can be read, with as many
    elements as it implies: one ValueError naming the file and the tensor otherwise (shapes only: nothing
    is read)."""
    if random_weights(Path(info.path)) is not None:   # drawn from the config's own shapes: nothing to check
        return
    src, names = open_source(Path(info.path)), names_of(info)
    want = expected_shapes(info)
    specs = [names.layer(i) for i in range(info.n_layers)]
    specs.append({"embed": names.embed} | {f"final_norm{'' if k == 'w' else '_b'}": v for k, v in names.final_norm.items()})
    for spec in specs:
        for canonical, source in spec.items():
            parts = (source,) if isinstance(source, str) else source
            experts = info.moe.n_experts if info.moe is not None and any("{e}" in n for n in parts) else 1
            numel = 0
            for n in (p.format(e=e) for e in range(experts) for p in parts):
                if not src.has(n):
                    raise ValueError(f"{info.path}: tensor {n} missing (model_type {info.arch})")
                numel += math.prod(src.shape(n))
            expected = math.prod(want[canonical]) if canonical in want else numel
            if numel != expected:
                raise ValueError(f"{info.path}: {' + '.join(parts)} has {numel} elements, but the config implies "
                                 f"{canonical} of shape {want[canonical]}")
