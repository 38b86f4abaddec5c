"""A checkpoint whose weights are made at load instead of read: a Hugging Face directory with config.json
(and a tokenizer) and `random_weights.json` in place of *.safetensors. Each tensor the config implies
is drawn on the stage's own device in its dtype, from a seed of its own (the seed, its layer, its
name), so every process of a pipeline or tensor-parallel group makes the same model without a file
between them. What it is for: measuring a published shape (tools/gpu_check.py --shape: an 8B model is
16 GB to carry, a 30B MoE 61 GB) where only the shape matters. Matrices are normal(0, std), norms
ones, biases and sinks zeros.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from orca_mq.models.info import ModelInfo
    from orca_mq.models.weights import StageWeights

MARKER = "random_weights.json"


@dataclass(frozen=True, slots=True)
class RandomWeights:
    seed: int = 0
    std: float = 0.02

    def save(self, directory: Path) -> None:
        (directory / MARKER).write_text(json.dumps(asdict(self)) + "\n")


def random_weights(path: Path) -> RandomWeights | None:
    """The directory's random-weights spec, or None where its weights are files."""
    f = path / MARKER
    if not path.is_dir() or not f.exists():
        return None
    try:
        return RandomWeights(**json.loads(f.read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{f}: expected {{\"seed\": int, \"std\": float}} ({e})") from None


def random_stage_weights(info: "ModelInfo", spec: RandomWeights, layers: range, first: bool, last: bool,
                         dtype: torch.dtype, device: torch.device) -> StageWeights:
    """What load_stage_weights gives for a checkpoint of files, drawn on `device` (canonical names and shapes)."""
    import torch

    from orca_mq.models.names import expected_shapes, names_of
    from orca_mq.models.weights import StageWeights

    names, shapes = names_of(info), expected_shapes(info)

    def make(name: str, where: str) -> torch.Tensor:
        if name.endswith(("_b", "sinks")):
            return torch.zeros(shapes[name], dtype=dtype, device=device)
        if name.endswith("norm"):
            return torch.ones(shapes[name], dtype=dtype, device=device)
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(f"{spec.seed}/{where}/{name}".encode()))
        return torch.randn(shapes[name], generator=gen, dtype=dtype, device=device).mul_(spec.std)

    out = StageWeights(layers=[{k: make(k, str(i)) for k in names.layer(i)} for i in layers])
    embed = make("embed", "model") if first or (last and names.lm_head is None) else None
    if first:
        out.embed, out.pos_embed = embed, make("pos_embed", "model") if names.pos_embed else None
    if last:
        out.final_norm = {k: make("final_norm" + ("" if k == "w" else "_b"), "model") for k in names.final_norm}
        out.lm_head = embed if names.lm_head is None else make("lm_head", "model")
    return out
