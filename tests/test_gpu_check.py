"""tools/gpu_check.py, kept working without a GPU: its quick sections end to end at --small sizes on
the CPU (the device run is the same code at full sizes), and prepare's wheel-requirement check."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from orca_mq.bench.gpu_carry import check_wheels
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
