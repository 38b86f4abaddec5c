"""A Llama layer's elementwise ops (RMSNorm with the residual add, rotary, the MLP's SiLU-gate) in
three implementations behind one interface; the attention backend brings the one for its device:
`TorchOps` (any device; torch's own ops), `CpuOps` (kernels/csrc/layer_ops_cpu.cpp: one pass per op,
float32 or bfloat16), `TritonOps` (CUDA: kernels/norm_rope_kernel.py, kernels/activation_kernel.py).

On the CPU each torch op is a dispatch and a pass over memory: a norm is 7 of them, rotary 9, the
activation 3, and at decode, a few rows, their Python and dispatch outweigh their arithmetic.
"""
from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class LayerOps(Protocol):
    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        """w * x / rms(x), float32 arithmetic, x's dtype out."""
        ...

    def add_rms_norm(self, h: Tensor, delta: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """The residual add and the next norm: (h + delta, rms_norm(h + delta)); `h` may be updated in place."""
        ...

    def rotary(self, qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, n_heads: int,
               n_kv_heads: int) -> tuple[Tensor, Tensor]:
        """Q [T, n_heads, d] and K [T, n_kv_heads, d] of a fused QKV output [T, (n_heads + 2 n_kv_heads) d],
        rotated by their positions (tables [max_pos, d], rotate-half layout); `qkv` may be rotated in place."""
        ...

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """[T, 2n] = [gate | up] -> silu(gate) * up [T, n]."""
        ...


def _split_qk(qkv: Tensor, n_heads: int, n_kv_heads: int, d: int) -> tuple[Tensor, Tensor]:
    t = qkv.shape[0]
    return qkv[:, : n_heads * d].view(t, n_heads, d), qkv[:, n_heads * d: (n_heads + n_kv_heads) * d].view(t, n_kv_heads, d)


class TorchOps:
    __slots__ = ()

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        xf = x.float()  # F.rms_norm is not fused on CPU and is far slower than these three ops
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def add_rms_norm(self, h: Tensor, delta: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        h = h + delta
        return h, self.rms_norm(h, w, eps)

    def rotary(self, qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, n_heads: int,
               n_kv_heads: int) -> tuple[Tensor, Tensor]:
        """Q and K heads rotate together: one set of elementwise ops, x cos + rotate_half(x) sin."""
        t, d = qkv.shape[0], cos.shape[-1]
        x = qkv[:, : (n_heads + n_kv_heads) * d].view(t, -1, d)
        half = d // 2
        c, s = cos[positions, None, :half], sin[positions, None, :half]   # the tables' halves are equal
        x1, x2 = x[..., :half], x[..., half:]
        qk = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        return qk[:, :n_heads], qk[:, n_heads:]

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuOps(TorchOps):
    """The C++ kernels for float32 / bfloat16 CPU tensors."""

    __slots__ = ("ext",)

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        return self.ext.rms_norm(x.contiguous(), None, w, eps)

    def add_rms_norm(self, h: Tensor, delta: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        h = h.contiguous()
        return h, self.ext.rms_norm(h, delta.contiguous(), w, eps)

    def rotary(self, qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, n_heads: int,
               n_kv_heads: int) -> tuple[Tensor, Tensor]:
        self.ext.rotary_(qkv, positions, cos, sin, n_heads + n_kv_heads)
        return _split_qk(qkv, n_heads, n_kv_heads, cos.shape[-1])

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return self.ext.silu_mul(gate_up.contiguous())


class TritonOps(TorchOps):
    """CUDA: the Triton norm, rotary and activation kernels, one launch each."""

    __slots__ = ("kernels",)

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        return self.kernels.rms_norm(x, w, eps)

    def add_rms_norm(self, h: Tensor, delta: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        normed, h = self.kernels.fused_add_rms_norm(delta, h, w, eps)
        return h, normed

    def rotary(self, qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, n_heads: int,
               n_kv_heads: int) -> tuple[Tensor, Tensor]:
        return self.kernels.rotary(*_split_qk(qkv, n_heads, n_kv_heads, cos.shape[-1]), positions, cos, sin)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return self.kernels.silu_mul(gate_up)   # torch's two ops were two launches and a [T, n] temporary
