"""A pipeline stage's weights in the canonical layout (models/names.py), from either kind of checkpoint,
through the family's names and conversions; and the check that a checkpoint holds every tensor its
config implies, in sizes that agree, made before any worker starts (shapes only, no data read).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from orca_mq.models.files import cache_key
from orca_mq.models.info import ModelInfo
from orca_mq.models.layers.rotary import partial_order
from orca_mq.models.names import Source, expected_shapes, names_of
from orca_mq.models.random_weights import random_stage_weights, random_weights
from orca_mq.models.registry import family
from orca_mq.models.sources import Source as Checkpoint
from orca_mq.models.sources import open_source

Tensor = torch.Tensor
# a layer's GEMM weights, [out, in] (experts: [E, out, in]); the rest are vectors
MATRICES = ("qkv", "o", "gate_up", "up", "down")
EXPERTS = ("experts_gate_up", "experts_down")


@dataclass(slots=True)
class StageWeights:
    """The tensors one pipeline stage needs; names are the canonical ones the model reads."""

    layers: list[dict[str, Tensor]]
    embed: Tensor | None = None        # stage 0 (and the last stage when the LM head is tied)
    pos_embed: Tensor | None = None    # GPT-2, stage 0
    final_norm: dict[str, Tensor] | None = None
    lm_head: Tensor | None = None


def load_stage_weights(info: ModelInfo, layers: range, first: bool, last: bool, dtype: torch.dtype,
                       cache_dir: str = "", device: torch.device | None = None) -> StageWeights:
    """A stage's weights; with `cache_dir`, a GGUF's dequantized tensors are saved there once and
    memory-mapped afterwards (seconds instead of a minute of dequantizing when a worker restarts).
    A checkpoint of random weights (models/random_weights.py) is drawn on `device` (default: the CPU)."""
    path = Path(info.path)
    if (spec := random_weights(path)) is not None:
        return random_stage_weights(info, spec, layers, first, last, dtype, device or torch.device("cpu"))
    if not cache_dir or not path.is_file():
        return _load(info, layers, first, last, dtype)
    cached = Path(cache_dir).expanduser() / f"stage2-{cache_key(path, layers.start, layers.stop, first, last, str(dtype))}.pt"
    try:
        return StageWeights(**torch.load(cached, mmap=True, weights_only=True))
    except (OSError, RuntimeError, TypeError, ValueError):
        pass  # missing, stale or torn: load and save again
    out = _load(info, layers, first, last, dtype)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
    torch.save({name: getattr(out, name) for name in StageWeights.__dataclass_fields__}, tmp)
    os.replace(tmp, cached)
    return out


def _load(info: ModelInfo, layers: range, first: bool, last: bool, dtype: torch.dtype) -> StageWeights:
    src, names = open_source(Path(info.path)), names_of(info)
    fam = family(info.arch)
    gguf = Path(info.path).is_file()

    def canonical(spec: dict[str, Source]) -> dict[str, Tensor]:
        t = {k: gather(src, v, k, info) for k, v in spec.items()}
        t = fam.convert(info, t, gguf) if fam.convert is not None else t
        t = permute_partial_rotary(info, t)
        check_shapes(info, t)
        return {k: v.to(dtype).contiguous() for k, v in t.items()}

    out = StageWeights(layers=[canonical(names.layer(i)) for i in layers])
    glob: dict[str, Source] = {}
    if first or (last and names.lm_head is None):
        glob["embed"] = names.embed
    if first and names.pos_embed:
        glob["pos_embed"] = names.pos_embed
    if last:
        glob |= {f"final_norm{'' if k == 'w' else '_b'}": v for k, v in names.final_norm.items()}
        if names.lm_head is not None and src.has(names.lm_head):
            glob["lm_head"] = names.lm_head
        else:
            glob.setdefault("embed", names.embed)   # a GGUF without output.weight: the head is tied
    g = canonical(glob)
    if first:
        out.embed, out.pos_embed = g.get("embed"), g.get("pos_embed")
    if last:
        out.final_norm = {"w": g["final_norm"]} | ({"b": g["final_norm_b"]} if "final_norm_b" in g else {})
        out.lm_head = g.get("lm_head", g.get("embed"))
    return out


def gather(src: Checkpoint, source: Source, canonical: str, info: ModelInfo) -> Tensor:
    """One canonical tensor: its parts concatenated (a bias or other vector along its only dim, a
    matrix along its rows), per expert when the names hold `{e}`."""
    parts = (source,) if isinstance(source, str) else source
    dim = -1 if canonical.endswith("_b") else -2

    def read(names: tuple[str, ...]) -> Tensor:
        for n in names:
            if not src.has(n):
                raise ValueError(f"{src.path}: tensor {n} missing (model_type {info.arch})")
        ts = [src.get(n) for n in names]
        return ts[0] if len(ts) == 1 else torch.cat(ts, dim)

    if any("{e}" in n for n in parts):
        assert info.moe is not None
        return torch.stack([read(tuple(n.format(e=e) for n in parts)) for e in range(info.moe.n_experts)])
    return read(parts)


def permute_partial_rotary(info: ModelInfo, t: dict[str, Tensor]) -> dict[str, Tensor]:
    """A partial rotary runs as a whole-head one over permuted q and k dims (models/layers/rotary.py)."""
    if not info.rotary_dim or info.rotary_dim == info.head_dim or "qkv" not in t:
        return t
    d, qk = info.head_dim, (info.n_heads + info.n_kv_heads) * info.head_dim
    order = partial_order(d, info.rotary_dim)
    rows = torch.cat([(torch.arange(qk) // d) * d + order.repeat(qk // d), torch.arange(qk, t["qkv"].shape[0])])
    out = dict(t)
    out["qkv"] = t["qkv"].index_select(0, rows)
    if "qkv_b" in t:
        out["qkv_b"] = t["qkv_b"].index_select(0, rows)
    for k in ("q_norm", "k_norm"):
        if k in t:
            out[k] = t[k].index_select(0, order)
    return out


def check_shapes(info: ModelInfo, t: dict[str, Tensor]) -> None:
    want = expected_shapes(info)
    for k, v in t.items():
        if k in want and tuple(v.shape) != want[k]:
            raise ValueError(f"{info.path}: {k} has shape {tuple(v.shape)}, but the config implies {want[k]}")
