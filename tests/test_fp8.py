"""FP8 (issue 42, item 4) where it can be checked without a GPU: the e4m3 quantize / dequantize
arithmetic against the bound its 3 mantissa bits give, a GEMM through torch._scaled_mm (the call the
GPU makes) against that bound summed over the reduction, the seam in engine/gemm.py, and the refusal
at start on a device without FP8 (the runner, and the server's one line before any process starts)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orca_mq.config import load_config
from orca_mq.engine import fp8, gemm
from orca_mq.runtime.device import check_fp8
from orca_mq.server.process import ROOT, free_port

U = 2.0 ** -4   # e4m3: half of the 2^-3 relative spacing of its normal values
F32 = 2.0 ** -24


def _rows(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    """Rows of very different magnitudes, each with values deep in e4m3's subnormal range once scaled."""
    x = torch.randn(n, k, generator=gen, dtype=torch.float64) * torch.logspace(-4, 4, n, dtype=torch.float64)[:, None]
    x[:, :4] *= 1e-5
    x[-1] = 0.0   # an all-zero row
    return x.float()


def test_a_row_round_trips_within_the_bound_of_three_mantissa_bits() -> None:
    x = _rows(torch.Generator().manual_seed(1), 64, 256)
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1) and torch.isfinite(scale).all()
    err = (fp8.dequantize(q, scale) - x).abs()
    assert (err <= fp8.error_bound(x, scale)).all()
    assert (fp8.dequantize(q, scale)[-1] == 0).all()
    normal = x.abs() >= scale * 2.0 ** -6
    assert (err[normal] / x.abs()[normal]).max() > U / 2, "the values were not rounded to 3 bits"
    # the bound is not loose enough to hold anything: a scale half as large clips each row's largest value
    clipped = (x / (scale / 2)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * (scale / 2)
    assert ((clipped - x).abs() > fp8.error_bound(x, scale)).any()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_a_gemm_through_scaled_mm_errs_within_the_bound_summed_over_its_reduction(out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    k = 1024
    x = _rows(gen, 48, k)
    w = (torch.randn(80, k, generator=gen) * torch.rand(80, 1, generator=gen) * 0.1).to(out_dtype)
    prepared = gemm.prepare(w, "fp8")
    assert isinstance(prepared, fp8.Fp8Weight) and prepared.dtype == out_dtype and prepared.shape == w.shape
    b = torch.randn(80, generator=gen).to(out_dtype)
    y = gemm.linear(x.to(out_dtype), prepared, b)
    assert y.dtype == out_dtype and y.shape == (48, 80)
    xs, ws = x.to(out_dtype).double(), w.double()
    exact = xs @ ws.T + b.double()
    _, sx = fp8.quantize_rows(x.to(out_dtype))
    ex, ew = fp8.error_bound(x.to(out_dtype), sx).double(), fp8.error_bound(w, prepared.scale.T).double()
    mags = xs.abs() @ ws.abs().T
    bound = ex @ ws.abs().T + xs.abs() @ ew.T + ex @ ew.T + 2 * k * F32 * (mags + ex @ ew.T)
    if out_dtype == torch.bfloat16:   # the product and the bias each rounded to bf16 (8 bits)
        bound += 2.0 ** -8 * (exact.abs() + bound + b.double().abs()) * 2
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), float((err - bound).max())
    assert err.max() > 1e-3 * bound.max(), "no quantization error at all: the product did not run in e4m3"


def test_shapes_scaled_mm_cannot_take_stay_in_the_compute_dtype() -> None:
    w = torch.randn(24, 40)
    assert gemm.prepare(w, "fp8") is w
    assert isinstance(gemm.prepare(torch.randn(32, 48), "fp8"), fp8.Fp8Weight)


@pytest.mark.parametrize("key", ["model.quantization", "engine.kv_cache_dtype"])
def test_fp8_is_refused_at_start_where_the_device_has_none(tiny_llama_dir: Path, key: str) -> None:
    from orca_mq.engine.model_runner import ModelRunner

    cfg = load_config(overrides={"model.path": str(tiny_llama_dir), "engine.device": "cpu", key: "fp8"})
    with pytest.raises(ValueError) as e:
        ModelRunner(cfg)
    assert f"{key} = fp8 needs a GPU with FP8" in str(e.value) and "cpu has no FP8 tensor cores" in str(e.value)
    with pytest.raises(ValueError, match="the engine runs on the CPU here"):
        check_fp8(cfg)


def test_the_server_refuses_fp8_on_the_cpu_in_one_line_before_any_process_starts(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "orca_mq.cli", "serve", "--set", "model.quantization=fp8", "--set",
                          "engine.device=cpu", "--set", "server.http_address=", "--set", f"log.dir={tmp_path}",
                          "--set", f"server.frontend_address=tcp://127.0.0.1:{free_port()}"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert lines[0].startswith("orca-mq: fp8: model.quantization = fp8 needs a GPU with FP8"), lines
    assert "loading the model" not in run.stderr and run.stdout == ""
