"""The C++ layer ops (kernels/csrc/layer_ops_cpu.cpp via engine/layer_ops.CpuOps) equal torch's
(TorchOps) to the roundings the two computations make, on one row (decode) and on many (the OpenMP
path). The tolerances come from the dtype and the arithmetic, not from a host: torch rounds every
intermediate to the dtype, the C++ ops compute in float32 and round once, so a result may differ by
the sum of both sides' roundings (unit roundoff u each) plus a float32 reduction's error; inputs are
of unit scale, which bounds cancellation (rotary's differences) by the same amount absolutely."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels
from orca_mq.engine.layer_ops import CpuOps, TorchOps

REF = TorchOps()


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    ext = cpu_kernels.load()
    assert ext is not None, "the CPU kernels must build on this machine (gcc is required)"
    return CpuOps(ext)


HIDDEN = 576
NORM = 4        # roundings: torch's norm rounds the normalized row, then its product with w; the C++ op the same two
SILU_MUL = 3 + 4  # torch rounds silu(gate), then the product; the C++ op rounds the product once, after a
                  # vectorized float32 exp (-ffast-math) within 2 ulp (4 units) of the correctly rounded one
ROTARY = 4      # torch rounds x1 cos, x2 sin and their difference; the C++ op the difference once


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, roundings: int, reduction: int = 1) -> bool:
    """Within `roundings` roundings to dtype and a float32 sum of `reduction` terms, relative to unit scale."""
    tol = roundings * torch.finfo(dtype).eps / 2 + reduction * torch.finfo(torch.float32).eps / 2
    return a.dtype == b.dtype and bool(((a.float() - b.float()).abs() <= tol * (1 + b.float().abs())).all())


@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activation_match_torch(ops: CpuOps, rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, HIDDEN, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    assert close(ops.rms_norm(h, w, 1e-5), REF.rms_norm(h, w, 1e-5), dtype, NORM, HIDDEN)
    expect_h, expect = REF.add_rms_norm(h, delta, w, 1e-5)
    got_h, got = ops.add_rms_norm(h.clone(), delta, w, 1e-5)
    assert torch.equal(got_h, expect_h) and close(got, expect, dtype, NORM, HIDDEN)   # the residual add is exact
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-200.0, 0.0, 200.0])   # saturating gates stay finite
    assert close(ops.silu_mul(gate_up), REF.silu_mul(gate_up), dtype, SILU_MUL)


@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rotates_q_and_k_in_place_and_leaves_v(ops: CpuOps, rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7 + rows)
    n_heads, n_kv, d, max_pos = 9, 3, 64, 2048
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv).repeat(1, 2)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = torch.randn(rows, (n_heads + 2 * n_kv) * d, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (rows,), generator=gen)
    q_ref, k_ref = REF.rotary(qkv.clone(), positions, cos, sin, n_heads, n_kv)
    v_before = qkv[:, (n_heads + n_kv) * d:].clone()
    q, k = ops.rotary(qkv, positions, cos, sin, n_heads, n_kv)
    assert q.shape == q_ref.shape and k.shape == k_ref.shape
    assert close(q, q_ref, dtype, ROTARY) and close(k, k_ref, dtype, ROTARY)
    assert q.data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, (n_heads + n_kv) * d:], v_before)
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rotary(qkv, torch.full((rows,), max_pos), cos, sin, n_heads, n_kv)
