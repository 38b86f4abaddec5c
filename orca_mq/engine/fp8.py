"""FP8 (e4m3) on GPUs with FP8 tensor cores (Hopper, Ada): the arithmetic (the check at start:
runtime/device.py check_fp8).

Weights (`model.quantization = "fp8"`): each output channel (a row of the [out, in] weight) in e4m3
with its own float32 scale, made once at load (engine/gemm.py prepare); at every GEMM the activations
get a scale per token (row) and the product runs in torch._scaled_mm, which applies both scales
to its fp32 accumulator and writes the compute dtype. The LM head stays in the compute dtype (as
vLLM keeps it): the sampled tokens' logits are the most sensitive product. KV
(`engine.kv_cache_dtype = "fp8"`): a scale per token and KV head, the same rows as here
(kernels/kv_fp8_kernel.py writes them, kernels/split_kv_kernel.py reads them).

A row x with s = max|x| / 448 (e4m3's largest finite) is stored as q = rne(x / s) in e4m3, x ~ q s.
With 3 mantissa bits a normal e4m3 value is within 2^-4 of what it rounds (half of its 2^-3
relative spacing); below 2^-6, e4m3's smallest normal, values are subnormal at a fixed spacing of
2^-9, so the error is at most 2^-10. Scaled back: |x - q s| <= max(2^-4 |x|, 2^-10 s) (`error_bound`),
and a dot product of n pairs errs by at most sum(e_x |w| + |x| e_w + e_x e_w) plus fp32 accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_SCALE = 2.0 ** -126   # an all-zero row: any positive scale gives zeros; this keeps x / s finite
ALIGN = 16                # torch._scaled_mm's operands: in and out features multiples of this


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., n] -> (e4m3 [..., n], float32 scales [..., 1]): one scale per row."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(MIN_SCALE)
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale


def error_bound(x: Tensor, scale: Tensor) -> Tensor:
    """The most |x - dequantize(*quantize_rows(x))| can be, elementwise (scale: quantize_rows')."""
    return torch.maximum(x.float().abs() * 2.0 ** -4, scale * 2.0 ** -10)


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A weight for `linear`: [out, in] in e4m3, row-major, whose transpose is the column-major
    operand torch._scaled_mm takes, and its scales [1, out]; `dtype` is what it computes in."""

    q: Tensor
    scale: Tensor
    dtype: torch.dtype

    shape = property(lambda self: self.q.shape)
    device = property(lambda self: self.q.device)

    def numel(self) -> int:
        return self.q.numel()

    def element_size(self) -> int:
        return self.q.element_size()


def quantize_weight(w: Tensor) -> Fp8Weight | Tensor:
    """The weight in e4m3 with per-channel scales; as it is where _scaled_mm cannot take its shape."""
    if w.shape[0] % ALIGN or w.shape[1] % ALIGN:
        return w
    q, scale = quantize_rows(w)
    return Fp8Weight(q.contiguous(), scale.view(1, -1).contiguous(), w.dtype)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize_rows` of a GEMM's input [T, in]: on CUDA one Triton kernel (the same bytes; in torch it
    is seven kernels, which cost more than FP8 saves), elsewhere in torch."""
    if x.is_cuda:
        from kernels.fp8_quant_kernel import quantize_rows_fp8

        return quantize_rows_fp8(x)
    return quantize_rows(x)


def linear(x: Tensor, w: Fp8Weight, b: Tensor | None = None) -> Tensor:
    """x [T, in] (scaled per token here) @ w.T (+ b) -> [T, out] in w.dtype."""
    if x.shape[0] == 0:
        return x.new_empty(0, w.shape[0])
    xq, sx = quantize_activations(x)
    y = torch._scaled_mm(xq, w.q.t(), scale_a=sx, scale_b=w.scale, out_dtype=w.dtype)
    return y if b is None else y + b


def unsupported(device: torch.device) -> str | None:
    """Why `device` cannot run the FP8 paths (None: it can): FP8 tensor cores (compute capability
    8.9+) and torch._scaled_mm with a scale per row, found by trying."""
    if device.type != "cuda":
        return f"{device.type} has no FP8 tensor cores"
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        return f"{torch.cuda.get_device_name(device)} (compute capability {cc[0]}.{cc[1]}) has no FP8 tensor cores (8.9+)"
    try:   # one row (decode at batch 1) and a ragged count
        for rows in (1, 33):
            linear(torch.ones(rows, ALIGN, device=device, dtype=torch.bfloat16),
                   quantize_weight(torch.ones(ALIGN, ALIGN, device=device, dtype=torch.bfloat16)))  # type: ignore[arg-type]
    except RuntimeError as e:
        return f"torch._scaled_mm with per-row scales fails on {torch.cuda.get_device_name(device)}: {str(e)[:120]}"
    return None


def require(what: str, device: torch.device) -> None:
    """Refuse `what` (a config setting) at start, in one line, where FP8 cannot run."""
    if (why := unsupported(device)) is not None:
        raise ValueError(f"{what} needs a GPU with FP8 (Hopper or Ada): {why}")


def refuse_kv(device: torch.device) -> None:
    """`engine.kv_cache_dtype = "fp8"`: refused at start, in one line, on every device for now."""
    require("engine.kv_cache_dtype = fp8", device)
    raise ValueError("engine.kv_cache_dtype = fp8: no attention backend reads e4m3 KV yet (the ragged kernel's "
                     "prompt rows do not; the KV write and the split-KV decode kernel do)")
