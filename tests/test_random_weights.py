"""A checkpoint of random weights (orca_mq/models/random_weights.py: config.json and random_weights.json,
no tensor files): every family's stage holds the tensors a checkpoint of files gives, in the same canonical
names, shapes and dtype; a layer's tensors are the same whichever stage draws them; the start-up check
passes it, and a malformed spec is one line naming its file."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from orca_mq.bench.random_models import FAMILIES, family_config, save_random_model
from orca_mq.models.random_weights import MARKER, RandomWeights
from orca_mq.models.registry import read_model_info
from orca_mq.models.checked import check_checkpoint
from orca_mq.models.weights import StageWeights, load_stage_weights

DTYPE = torch.bfloat16


def _pair(root: Path, family: str) -> tuple[Path, Path]:
    """(a checkpoint of files, the same config with random weights)."""
    files = save_random_model(root / family, family_config(family))
    drawn = root / f"{family}-random"
    drawn.mkdir()
    shutil.copy(files / "config.json", drawn)
    RandomWeights(seed=3).save(drawn)
    return files, drawn


def _layout(w: StageWeights) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {f"{i}.{k}": (tuple(t.shape), t.dtype) for i, layer in enumerate(w.layers) for k, t in layer.items()}
    out |= {f"final_norm.{k}": (tuple(t.shape), t.dtype) for k, t in (w.final_norm or {}).items()}
    out |= {k: (tuple(t.shape), t.dtype) for k in ("embed", "pos_embed", "lm_head") if (t := getattr(w, k)) is not None}
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_random_stage_has_the_checkpoints_tensors(tmp_path: Path, family: str) -> None:
    files, drawn = _pair(tmp_path, family)
    info_files, info = read_model_info(str(files)), read_model_info(str(drawn))
    check_checkpoint(info)   # nothing to read: passes without tensor files
    n = info.n_layers
    for layers, first, last in ((range(n), True, True), (range(0, n // 2), True, False), (range(n // 2, n), False, True)):
        want = load_stage_weights(info_files, layers, first, last, DTYPE)
        got = load_stage_weights(info, layers, first, last, DTYPE)
        assert _layout(got) == _layout(want)
    whole = load_stage_weights(info, range(n), True, True, DTYPE)
    assert (whole.lm_head is whole.embed) == info.tie_embeddings   # a tied head: one tensor
    for k, t in whole.layers[0].items():
        if k.endswith("norm"):
            assert torch.equal(t, torch.ones_like(t)), k
        elif k.endswith(("_b", "sinks")):
            assert not t.any(), k
        else:   # drawn at std 0.02: far from zero, far from one
            assert 0.01 < t.float().std().item() < 0.04, k


def test_a_layer_is_the_same_whichever_stage_draws_it(tmp_path: Path) -> None:
    _, drawn = _pair(tmp_path, "qwen3_moe")
    info = read_model_info(str(drawn))
    whole = load_stage_weights(info, range(4), True, True, DTYPE)
    later = load_stage_weights(info, range(2, 4), False, True, DTYPE)
    for a, b in zip(whole.layers[2:], later.layers):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(whole.lm_head, later.lm_head)
    first, second = whole.layers[0]["qkv"], whole.layers[1]["qkv"]
    assert not torch.equal(first, second)   # each tensor its own seed
    RandomWeights(seed=4).save(drawn)
    assert not torch.equal(load_stage_weights(info, range(1), True, False, DTYPE).layers[0]["qkv"], first)


def test_a_malformed_spec_is_one_line_naming_its_file(tmp_path: Path) -> None:
    _, drawn = _pair(tmp_path, "llama")
    (drawn / MARKER).write_text('{"seed": 1, "mean": 0}')
    info = read_model_info(str(drawn))
    with pytest.raises(ValueError, match=f"{MARKER}: expected"):
        load_stage_weights(info, range(1), True, False, DTYPE)
