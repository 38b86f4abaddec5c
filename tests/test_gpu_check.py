"""tools/gpu_check.py, kept working without a GPU: its quick sections and a --shape run end to end at
--small sizes on the CPU (the device run is the same code at full sizes), the shapes' configs against
the published checkpoints, and prepare's wheel-requirement check."""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from orca_mq.bench.gpu_carry import check_wheels
from orca_mq.bench.shapes import SHAPES, ShapeRun, add_shape_args
from orca_mq.models.registry import read_model_info
from orca_mq.models.names import expected_shapes, names_of
from orca_mq.server.process import ROOT

QUICK = ("env", "refusal", "kernels", "exactness")


def test_quick_sections_run_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "run", "--small", "--sections", ",".join(QUICK),
                          "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"]
    lines = (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows
    done = {r["section"]: r["exit"] for r in rows if r.get("detail") == "section done"}
    assert done == {"models": 0, **{s: 0 for s in QUICK}}, done
    assert not [r for r in rows if r.get("met") is False], [r for r in rows if r.get("met") is False]
    table = out.stdout[out.stdout.index("gpu_check: 4 sections"):]   # the table comes last
    for figure in ("refused at start", "max rel err vs reference", "fp32 logits vs transformers, cpu attention",
                   "bf16 logits"):
        assert figure in table, table
    refusal = next(r for r in rows if r["section"] == "refusal" and "figure" in r)
    assert refusal["met"] and "0 CUDA device(s)" in refusal["stderr"]


def _wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\nName: {name}\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    return path


def test_prepare_checks_each_wheels_requirements(tmp_path: Path) -> None:
    base = [_wheel(tmp_path, "pydantic", "2.13.4", "typing-extensions>=4.14.1", "annotated-types>=0.6",
                   'email-validator>=2; extra == "email"', 'tzdata; platform_system == "Windows"'),
            _wheel(tmp_path, "typing_extensions", "4.16.0"), _wheel(tmp_path, "annotated_types", "0.7.0"),
            _wheel(tmp_path, "uvicorn", "0.54.0", "click>=7.0", "h11>=0.8")]
    lines = check_wheels(base)
    assert "typing-extensions>=4.14.1 (carried)" in lines[0] and "email" not in lines[0] and "tzdata" not in lines[0]
    assert "click>=7.0 (on the image)" in lines[3]
    with pytest.raises(RuntimeError, match="neither carried nor on the device image"):
        check_wheels(base + [_wheel(tmp_path, "fastapi", "0.165.0", "starlette>=1.6")])
    with pytest.raises(RuntimeError, match="typing-extensions 4.16.0 is carried"):
        check_wheels(base + [_wheel(tmp_path, "future", "1.0", "typing-extensions>=5")])
    with pytest.raises(RuntimeError, match="two wheels of typing_extensions"):
        check_wheels(base + [_wheel(tmp_path / "..", "typing_extensions", "4.15.0")])


# the published checkpoints' parameter counts (their safetensors' totals on the Hugging Face hub)
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360,
             "qwen3-30b-a3b": 30_532_122_624}


def _params(path: Path) -> int:
    """Every tensor the config at `path` implies (a tied head once), from the shapes alone."""
    info = read_model_info(str(path))
    names, shapes = names_of(info), expected_shapes(info)
    keys = [k for i in range(info.n_layers) for k in names.layer(i)] + ["embed", "final_norm"]
    return sum(math.prod(shapes[k]) for k in keys + ["lm_head"] * (names.lm_head is not None))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shapes_are_the_published_checkpoints(tmp_path: Path, name: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(ShapeRun(name).config(small=False)))
    assert _params(tmp_path) == PUBLISHED[name]
    cut = ShapeRun(name, layers=3).config(small=False)
    assert cut["num_hidden_layers"] == 3 and cut["hidden_size"] == SHAPES[name]["hidden_size"]


def test_shape_options_reach_the_sections_and_need_shape() -> None:
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    run = ShapeRun("qwen3-8b", layers=4, fp8=True)
    assert ShapeRun.from_args(ap.parse_args(run.argv())) == run
    assert ShapeRun.from_args(ap.parse_args([])) is None
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "run", "--fp8", "--out", "/nonexistent"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "need --shape" in out.stderr, out.stderr


def test_a_shape_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    """--shape qwen3-30b-a3b --small: the MoE shape, narrow, through both shape sections (decode and
    prompts beside their floors and the probe, the served and offline bursts), the figures' arithmetic
    consistent with the checkpoint it drew."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "run", "--small", "--shape", "qwen3-30b-a3b",
                          "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"]
    done = {r["section"]: r["exit"] for r in rows if r.get("detail") == "section done"}
    assert done == {"shape_iteration": 0, "shape_burst": 0}, done
    assert not [r for r in rows if r.get("met") is False], [r for r in rows if r.get("met") is False]
    fig = {r["figure"]: r for r in rows if r.get("figure")}
    drawn = tmp_path / "work" / "models" / "qwen3-30b-a3b-2l-small"
    assert fig["qwen3-30b-a3b: 2 layers, random weights made on cpu"]["weight_bytes"] == 4 * _params(drawn)   # float32
    one, four = (fig[f"decode b={b} ctx=48: engine / bandwidth floor"] for b in (1, 4))
    assert four["kv_bytes"] == 4 * one["kv_bytes"] > 0
    assert four["weight_bytes"] > one["weight_bytes"]   # 4 rows route to more of the 8 experts than 1 (top-2)
    assert all(fig[f"decode b={b} ctx=48: engine / CUDA-graph probe"]["probe"]["eager_ms"] > 0 for b in (1, 4))
    p1, p2 = (fig[f"prefill {n} prompt(s) of 48: engine / FLOP floor"]["flops"] for n in (1, 2))
    assert p2 == 2 * p1
    served = next(r for r in rows if r.get("detail") == "served measured burst")
    assert served["n_ok"] == 12 and fig["served burst: errors"]["met"]
    assert fig["the same trace offline (LLM.generate): gen tok/s"]["gen_tokens"] == served["total_generated_tokens"]
