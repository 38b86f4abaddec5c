"""`model.dtype = "auto"`: bfloat16 where the CPU computes it natively, float32 everywhere else.

Native means the oneDNN GEMMs torch runs have bfloat16 instructions to use (AVX512-BF16 or AMX):
there bfloat16 weights halve the memory traffic and the GEMMs run 2-4x faster than float32; on an
AVX2-only CPU bfloat16 is emulated and slower than float32. Read from /proc/cpuinfo at run time,
so one install serves both. On CUDA auto is bfloat16: on an H200 its logits were as close to float32 as
transformers' own bfloat16 (../shared/gpu/RESULTS.md, tools/gpu_check.py).
"""
from __future__ import annotations

import functools
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (empty where /proc/cpuinfo is unreadable: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def native_bf16_flags() -> list[str]:
    return [f for f in NATIVE_BF16_FLAGS if f in cpu_flags()]


def resolve_dtype(dtype: str, device: str) -> str:
    """The compute dtype for `model.dtype` and `engine.device` (auto | cpu | cuda)."""
    if dtype != "auto":
        return dtype
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "bfloat16" if device == "cuda" or native_bf16_flags() else "float32"
