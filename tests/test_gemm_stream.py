"""engine.gemm = stream: calls of at most STREAM_ROWS rows go to the CPU extension's linear_rows
(kernels/csrc/linear_rows_cpu.cpp), which must equal a float64 product to float32 rounding for every
shape, give a row the same bits whatever the call's row count, and hand larger calls to oneDNN. Its
bfloat16 tiles (a mixture of experts' grouped path on the CPU: AVX512-BF16's dot-product instruction where
the CPU has it, else widened loads) must equal it to float32 accumulation and one bfloat16 rounding."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_mq.engine import gemm

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not gemm.stream_usable(CPU, torch.float32),
                                reason="needs oneDNN and the CPU kernels (gcc)")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """float32 dot products: within a few float32 roundings of the sum of the terms' magnitudes."""
    want = reference(x, w, b)
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return got.dtype == torch.float32 and bool(((got.double() - want).abs() <= 1e-6 * (scale + 1)).all())


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 24), n=st.integers(1, 700), k8=st.integers(1, 200), bias=st.booleans(), seed=st.integers(0, 2**31))
def test_stream_linear_matches_a_float64_product(m: int, n: int, k8: int, bias: bool, seed: int) -> None:
    """Every row count (1..STREAM_ROWS by the kernel: tiles of 1-4 rows of x, more by oneDNN), any N
    (the kernel's tiles of 1-8 rows of w and its split over threads), K in vectors of 8, with and without a bias."""
    g = torch.Generator().manual_seed(seed)
    k = 8 * k8
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    prepared = gemm.prepare(w, "stream")
    assert isinstance(prepared, gemm.Streamed) and prepared.shape == w.shape
    assert close(gemm.linear(x, prepared, b), x, w, b)


def test_a_row_gets_the_same_bits_at_every_row_count_up_to_the_kernels() -> None:
    """The kernel computes each output as one dot product in a fixed order, so rows do not depend on
    their batch below STREAM_ROWS; above it oneDNN takes over and gives what it gives alone."""
    g = torch.Generator().manual_seed(0)
    w = gemm.prepare(torch.randn(1001, 576, generator=g), "stream")
    x = torch.randn(gemm.STREAM_ROWS, 576, generator=g)
    full = gemm.linear(x, w)
    assert all(torch.equal(gemm.linear(x[:m], w), full[:m]) for m in range(1, gemm.STREAM_ROWS))
    big = torch.randn(gemm.STREAM_ROWS + 5, 576, generator=g)
    assert torch.equal(gemm.linear(big, w), gemm.linear(big, w.reordered))
    assert gemm.linear(x[:0], w).shape == (0, 1001)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 24), n=st.integers(1, 400), k8=st.integers(1, 200), seed=st.integers(0, 2**31))
def test_bfloat16_rows_match_a_float64_product_to_one_rounding(m: int, n: int, k8: int, seed: int) -> None:
    """bfloat16 rows and weights (each product exact in float32), summed in float32 and rounded to
    bfloat16 once: within half a bfloat16 ulp (2^-8 relative) of float32's sum, which is within a few
    float32 roundings of the exact one; every K in vectors of 8 (AVX512-BF16 steps of 32, the last masked)."""
    g = torch.Generator().manual_seed(seed)
    k = 8 * k8
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    got = kernels().linear_rows(x, w)
    want = reference(x, w, None)
    sum32 = 1e-6 * (x.double().abs() @ w.double().abs().T + 1)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert bool(((got.double() - want).abs() <= 2**-8 * (want.abs() + sum32) + sum32).all())


def test_a_bfloat16_row_gets_the_same_bits_at_every_row_count() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1001, 584, generator=g).bfloat16()
    x = torch.randn(gemm.STREAM_ROWS, 584, generator=g).bfloat16()
    full = kernels().linear_rows(x, w)
    assert all(torch.equal(kernels().linear_rows(x[:m], w), full[:m]) for m in range(1, gemm.STREAM_ROWS))


def kernels():
    from kernels import cpu_kernels

    return cpu_kernels.load()


def test_the_method_is_chosen_once_by_what_runs_here() -> None:
    assert gemm.resolve_method("auto", CPU, torch.float32) == "stream"
    assert gemm.resolve_method("auto", CPU, torch.float32, deterministic=True) == "onednn"   # rows would cross STREAM_ROWS
    assert gemm.resolve_method("auto", CPU, torch.bfloat16) != "stream"
    with pytest.raises(ValueError, match="stream"):
        gemm.resolve_method("stream", CPU, torch.bfloat16)
    odd = gemm.prepare(torch.randn(16, 12), "stream")   # K not in whole vectors of 8: oneDNN alone
    assert not isinstance(odd, gemm.Streamed) and odd.is_mkldnn
