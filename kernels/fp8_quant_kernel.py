"""Triton kernel: activation rows in e4m3 with a float32 scale per row (FP8 GEMMs' per-token scaling).

orca_mq/engine/fp8.py's `quantize_rows` in torch is seven passes over the activations (a cast to fp32,
abs, the max, two divisions, a clamp, the cast to e4m3), each a kernel: on an H100 they made an FP8
GEMM 1.2-1.7x slower than the bf16 one it replaces (tools/gpu_check.py's fp8 section). Here one
program per row reads the row twice (its max, then the quantized values) and writes it once; the
arithmetic is the reference's step for step (max|x| / 448 floored at MIN_SCALE, x / scale rounded by
IEEE division, clamped to +-448, cast to nearest even), so on a GPU the bytes equal torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.kv_fp8_kernel import E4M3_MAX, MIN_SCALE

__all__ = ["quantize_rows_fp8"]

BLOCK = 1024   # elements a program loads at a time; a row is walked in such steps


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n, stride_xt, stride_qt, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + t * stride_xt
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < n, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / E4M3_MAX, MIN_SCALE)
    q_row = q_ptr + t * stride_qt
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -E4M3_MAX), E4M3_MAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=offs < n)
    tl.store(scale_ptr + t, scale)


def quantize_rows_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [T, n]`` (any float dtype; rows may be strided) -> (e4m3 ``[T, n]``, float32 scales ``[T, 1]``).
    One launch, nothing read back to the host (a CUDA graph may capture it)."""
    assert x.dim() == 2
    if x.stride(1) != 1:
        x = x.contiguous()
    T, n = x.shape
    q = torch.empty(T, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(T, 1, dtype=torch.float32, device=x.device)
    if T:
        _quantize_rows_kernel[(T,)](x, q, scale, n, x.stride(0), q.stride(0), BLOCK=min(BLOCK, triton.next_power_of_2(n)),
                                    num_warps=4)
    return q, scale
