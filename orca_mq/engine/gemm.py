"""Every GEMM of the engine goes through this module: `prepare` a weight once at load, `linear` it
at every iteration. One seam, so how the products run (and, later, a batch-invariant mode) is
chosen in one place for the projections, the MLP and the LM head alike.

Batch-invariant mode (`engine.deterministic`): a GEMM library picks its kernel, blocking and thread
split by the shape, so a row's result can change with how many rows share the call (MKL sgemm here
has three: 1 row, 2-3, 4 or more). `Rows(n, pad=True)`: every call has exactly n rows, the batch cut
into tiles and the last one zero-padded, so a row's products never depend on the batch. Where
`row_invariant` finds, by trying, that the library gives a row the same bits for every row count up
to n and at every place in the call (oneDNN float32 here), `Rows(n, pad=False)` only cuts batches
larger than n, and pays nothing below.

Methods (`engine.gemm`):
- `torch`: `F.linear` on the plain [out, in] weight (MKL sgemm for float32 on the CPU, cuBLAS on CUDA).
- `onednn`: the weight reordered once into oneDNN's blocked layout and multiplied by oneDNN's
  matmul (what torch.compile's CPU freezing emits). On this AVX2 host it ran the model's shapes
  1.1-1.3x faster than MKL for the layers and 1.7-3x for the 49,152-row LM head (BENCHMARKS.md).
- `stream`: `onednn`, and calls of at most STREAM_ROWS rows (decode at a small batch) by the CPU
  extension's `linear_rows`, which streams the plain weight from memory once (float32, K a multiple of
  8): oneDNN read a decode's weights at ~0.75x this kernel's rate here. The price: the plain weight
  is kept beside the reordered one (twice the weights' memory).
- `fp8` (`model.quantization = "fp8"`, CUDA with FP8 tensor cores): the weight in e4m3 with a scale
  per output channel, the activations scaled per token, multiplied by torch._scaled_mm (engine/fp8.py);
  a weight whose shape _scaled_mm cannot take stays as it was.
- `auto`: `stream` for float32 on a CPU where oneDNN and the extension run (except in deterministic
  mode: a row's bits would change where a batch crosses STREAM_ROWS); else `onednn` where oneDNN runs
  the dtype (float32 with any oneDNN build; bfloat16 only on CPUs with native bfloat16, found by
  trying); `torch` elsewhere (CUDA, float16).
A reordered weight is opaque: sharding (tensor parallelism) happens before `prepare`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from orca_mq.engine import fp8

Tensor = torch.Tensor
Method = Literal["torch", "onednn", "stream", "fp8"]
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# the most rows a call gives linear_rows: a decode at 4-16 rows took 0.59-0.75x the time with oneDNN's
# products on the development host (BENCHMARKS.md, stop 50), at 32 rows about as long (0.96x)
STREAM_ROWS = 16


@dataclass(frozen=True, slots=True)
class Streamed:
    """A weight for `stream`: oneDNN's layout for many rows, the plain [out, in] one for few."""

    reordered: Tensor
    plain: Tensor

    shape = property(lambda self: self.plain.shape)
    dtype = property(lambda self: self.plain.dtype)
    device = property(lambda self: self.plain.device)

    def numel(self) -> int:
        return self.plain.numel()

    def element_size(self) -> int:
        return self.plain.element_size()


Weight = Tensor | Streamed | fp8.Fp8Weight


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in ONEDNN_DTYPES and _onednn_runs(dtype)


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build run oneDNN's linear in `dtype`: its bfloat16 path needs
    AVX512-BF16/AMX or AVX-NE-CONVERT and refuses to run elsewhere, which only trying tells."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def stream_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and onednn_usable(device, dtype) and _stream_kernel() is not None


@functools.cache
def _stream_kernel() -> Callable[[Tensor, Tensor], Tensor] | None:
    from kernels import cpu_kernels

    ext = cpu_kernels.load()
    return None if ext is None else ext.linear_rows


def resolve_method(name: str, device: torch.device, dtype: torch.dtype, deterministic: bool = False,
                   quantization: str = "none") -> Method:
    if quantization == "fp8":
        fp8.require("model.quantization = fp8", device)
        if name != "auto":
            raise ValueError(f"model.quantization = fp8 multiplies by torch._scaled_mm: engine.gemm must be auto, not {name}")
        return "fp8"
    if name == "auto":
        if onednn_usable(device, dtype):
            return "stream" if not deterministic and stream_usable(device, dtype) else "onednn"
        return "torch"
    if name == "onednn" and not onednn_usable(device, dtype):
        raise ValueError(f"engine.gemm = onednn needs a CPU torch with oneDNN and float32/bfloat16, not {device} {dtype}")
    if name == "stream" and not stream_usable(device, dtype):
        raise ValueError(f"engine.gemm = stream needs float32 on a CPU with oneDNN and the CPU kernels, not {device} {dtype}")
    if name not in ("torch", "onednn", "stream"):
        raise ValueError(f"engine.gemm must be auto | torch | onednn | stream, got {name!r}")
    return name  # type: ignore[return-value]


def prepare(w: Tensor, method: Method) -> Weight:
    """The weight [out, in] in the layout(s) `linear` reads for `method`."""
    if method == "torch":
        return w
    if method == "fp8":
        return fp8.quantize_weight(w)
    reordered = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
    if method == "onednn" or w.shape[1] % 8:   # linear_rows takes K in whole vectors of 8
        return reordered
    return Streamed(reordered, w.contiguous())


@dataclass(frozen=True, slots=True)
class Rows:
    """How many rows one GEMM call takes: 0 = the whole batch (the default mode)."""

    n: int = 0
    pad: bool = True   # every call exactly n rows (the last tile zero-padded); False: at most n


def linear(x: Tensor, w: Weight, b: Tensor | None = None, rows: Rows = Rows()) -> Tensor:
    """x [T, in] @ w.T (+ b) -> [T, out], whatever layout `prepare` gave w; cut into calls as `rows` says."""
    t = x.shape[0]
    if not rows.n or t == 0 or t == rows.n or (t < rows.n and not rows.pad):
        return _linear(x, w, b)
    if rows.pad:
        x = F.pad(x, (0, 0, 0, -t % rows.n))
    return torch.cat([_linear(tile, w, b) for tile in x.split(rows.n)])[:t]


def row_invariant(w: Weight, b: Tensor | None, max_rows: int) -> bool:
    """Whether `linear` gives a row the same bits in a call of any 1..max_rows rows and at any place
    in it, found by trying: a library chooses its kernels by shape, dtype and machine, never by the
    values, so random rows stand for all."""
    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(max_rows, w.shape[1], generator=g, device=w.device).to(w.dtype)
    full = _linear(x, w, b)
    if not all(torch.equal(_linear(x[:m], w, b), full[:m]) for m in range(1, max_rows)):
        return False
    same = _linear(x[:1].expand(max_rows, -1).contiguous(), w, b)
    return bool((same == same[:1]).all())


def _linear(x: Tensor, w: Weight, b: Tensor | None) -> Tensor:
    if isinstance(w, fp8.Fp8Weight):
        return fp8.linear(x, w, b)
    if isinstance(w, Streamed):
        if 0 < x.shape[0] <= STREAM_ROWS:
            y = _stream_kernel()(x.contiguous(), w.plain)  # type: ignore[misc]
            return y if b is None else y.add_(b)
        w = w.reordered
    if not w.is_mkldnn:
        return F.linear(x, w, b)
    if x.shape[0] == 0:   # oneDNN refuses an empty batch
        return x.new_empty(0, w.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")
