"""GGUF for the families llama.cpp has (issue 40): each tiny checkpoint of tests/test_families.py written
as llama.cpp writes it (tests/gguf_writer.py, whose conventions transformers' own GGUF reader confirms),
then served from the GGUF: logits equal transformers' on the original checkpoint in fp32; the common
ggml types dequantized at load as transformers' GGUF reader dequantizes them; and a GGUF that cannot be
served is refused with one line naming the file and what is wrong."""
from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from orca_mq.bench.plans import mixed_iteration_logits
from orca_mq.bench.random_models import family_config, save_random_model
from orca_mq.config import load_config
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.models.registry import read_model_info
from orca_mq.models.checked import check_checkpoint
from tests.gguf_writer import write_gguf

TOL = 1e-4
# GGUF can carry: Gemma 2's attention scale only as head_dim (llama.cpp's rule), Qwen3-MoE no dense layers
GGUF_FAMILIES = {"llama": {}, "llama3_rope": {}, "qwen2": {}, "qwen3": {}, "mistral": {},
                 "gemma2": {"query_pre_attn_scalar": 16}, "gemma3": {}, "phi3": {}, "mixtral": {},
                 "qwen3_moe": {"mlp_only_layers": []}}
TRANSFORMERS_READS = ("llama", "llama3_rope", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe")


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(load_config(overrides={"model.path": str(path), "engine.block_size": 8, "engine.n_slots": 2048,
                                              "engine.threads_per_worker": 1, "model.dtype": "float32",
                                              "model.cache_dir": ""}))


def _logits(runner: ModelRunner, reference: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(1)
    vocab = runner.info.vocab_size
    prefills = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 33)]
    decodes = [[rng.randrange(vocab) for _ in range(n)] for n in (2, 17, 40)]
    ours = mixed_iteration_logits(runner, prefills, decodes, rng)
    with torch.no_grad():
        return ours, torch.stack([reference(torch.tensor([s])).logits[0, -1] for s in prefills + decodes])


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_family_gguf_equals_transformers(family, tmp_path):
    src = save_random_model(tmp_path / family, family_config(family, **GGUF_FAMILIES[family]))
    path = write_gguf(src, tmp_path / f"{family}.gguf")
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    if family in TRANSFORMERS_READS:   # the writer's tensor conventions are llama.cpp's: transformers reads them back
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, config=AutoConfig.from_pretrained(src),
                                                      dtype=torch.float32).eval()
        x = torch.randint(3, 256, (1, 40))
        with torch.no_grad():
            assert (theirs(x).logits - reference(x).logits).abs().max().item() <= TOL
    info = read_model_info(str(path))
    check_checkpoint(info)
    ours, expected = _logits(_runner(path), reference)
    assert (ours - expected).abs().max().item() <= TOL


T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K])
def test_quantized_types_dequantize_as_transformers_reads_them(qtype, tmp_path):
    """A Llama of width 256 (the K types' block) with its matrices in `qtype`: our logits equal those of
    transformers' GGUF reader on the same file (both dequantize to float32 once, at load)."""
    src = save_random_model(tmp_path / "m", family_config("llama3_rope", hidden_size=256, intermediate_size=256,
                                                          num_attention_heads=4, num_key_value_heads=2, layers=2))
    path = write_gguf(src, tmp_path / "m.gguf", qtype)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, config=AutoConfig.from_pretrained(src),
                                                  dtype=torch.float32).eval()
    ours, expected = _logits(_runner(path), theirs)
    assert (ours - expected).abs().max().item() <= TOL * max(1.0, expected.abs().max().item())


def _rewrite(src: Path, out: Path, edit=lambda n, k, d: (k, d), arch: str | None = None) -> Path:  # type: ignore[no-untyped-def]
    """A copy of GGUF `src` with `edit(name, tensor type, data)` -> (type, data) applied to every tensor
    (and another general.architecture)."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, arch or reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, kind = field.contents(), field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(name, value)
        else:
            w.add_key_value(name, value, kind)
    for t in reader.tensors:
        kind, data = edit(t.name, t.tensor_type, t.data)
        w.add_tensor(t.name, data, raw_dtype=kind if kind not in (T.F32,) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_gguf_that_cannot_be_served_is_one_line(tmp_path):
    """An architecture orca-mq does not have, a tensor type it cannot read, a tensor whose size disagrees
    with the metadata: each a ValueError naming the file and what is wrong, before any weight is read."""
    src = save_random_model(tmp_path / "m", family_config("qwen3"))
    good = write_gguf(src, tmp_path / "good.gguf")
    with pytest.raises(ValueError, match=r"bad_arch\.gguf: GGUF architecture 'rwkv6' not supported"):
        read_model_info(str(_rewrite(good, tmp_path / "bad_arch.gguf", arch="rwkv6")))
    q81 = _rewrite(good, tmp_path / "q81.gguf", lambda n, k, d: (T.Q8_1, np.zeros((d.shape[0], d.shape[1] // 32 * 40), np.uint8))
                   if n == "blk.0.attn_q.weight" else (k, d))
    with pytest.raises(ValueError, match=r"q81\.gguf: tensor blk\.0\.attn_q\.weight has ggml type Q8_1"):
        check_checkpoint(read_model_info(str(q81)))
    short = _rewrite(good, tmp_path / "short.gguf", lambda n, k, d: (k, d[:-1]) if n == "blk.1.ffn_down.weight" else (k, d))
    with pytest.raises(ValueError, match=r"short\.gguf: blk\.1\.ffn_down\.weight has \d+ elements, but the config implies down"):
        check_checkpoint(read_model_info(str(short)))
