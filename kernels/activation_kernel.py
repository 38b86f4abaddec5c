"""Triton kernel: the Llama MLP's activation, ``silu(gate) * up`` of the fused gate/up projection."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

__all__ = ["silu_mul"]

_BLOCK = 1024  # columns per program: memory-bound, 8 per thread at 4 warps
# The interpreter has no libdevice; there tl.exp (numpy's) stands in for CUDA's expf.
_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0).to(tl.float32)
    # torch's silu, x / (1 + exp(-x)), with CUDA's expf and an IEEE division (Triton's tl.exp and `/`
    # are approximate on CUDA): the same bits as F.silu
    if LIBDEVICE:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    act = tl.math.div_rn(gate, 1.0 + e)
    # torch (and HF's LlamaMLP) rounds silu(gate) to the dtype before the product
    act = act.to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + row * stride_o + offs, (act * up).to(o_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``[T, 2n] = [gate | up] -> silu(gate) * up [T, n]``, fp32 math, one launch; a new tensor of the input dtype."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "expected [T, 2n]"
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    T, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0 or n == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(n))
    _silu_mul_kernel[(T, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, LIBDEVICE=_LIBDEVICE,
    )
    return out
