"""Selective-batching kernels: Triton versions and their plain-torch references.

    from kernels import write_kv, ragged_paged_attention, rms_norm, fused_add_rms_norm, rotary
    from kernels import rotary_write_kv, silu_mul
    from kernels import write_kv_ref, ragged_paged_attention_ref, rms_norm_ref, ...

The reference functions (``kernels.reference``) are imported eagerly and never
import triton. The Triton functions are imported lazily on first attribute
access, so ``import kernels`` does not import triton: that matters because
``TRITON_INTERPRET=1`` (needed to run the kernels on CPU tensors) only takes
effect if it is set before triton is first imported. On CPU without the
interpreter use the ``*_ref`` functions (or the engine's own torch path).

``rotary`` and ``silu_mul`` are out of place (return new tensors); ``write_kv`` is in place, and so is
``rotary_write_kv`` (rotary and the KV write in one launch: rotates the Q and K heads of the fused QKV
output where they lie, returns Q as a view of it).
The engine reaches them through its ``triton`` attention backend
(orca_mq/engine/attention/triton.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from .reference import (
    fused_add_rms_norm_ref,
    ragged_paged_attention_ref,
    rms_norm_ref,
    rotary_ref,
    rotary_write_kv_ref,
    silu_mul_ref,
    write_kv_ref,
)

_TRITON_FUNCS = {
    "write_kv": ".kv_write_kernel",
    "ragged_paged_attention": ".attention_kernel",
    "rms_norm": ".norm_rope_kernel",
    "fused_add_rms_norm": ".norm_rope_kernel",
    "rotary": ".norm_rope_kernel",
    "rotary_write_kv": ".rotary_kv_kernel",
    "silu_mul": ".activation_kernel",
}

__all__ = [
    "write_kv",
    "ragged_paged_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary",
    "rotary_write_kv",
    "silu_mul",
    "write_kv_ref",
    "ragged_paged_attention_ref",
    "rms_norm_ref",
    "fused_add_rms_norm_ref",
    "rotary_ref",
    "rotary_write_kv_ref",
    "silu_mul_ref",
    "triton_usable",
]


def triton_usable(device) -> bool:
    """True if the Triton kernels can run on tensors of ``device``.

    CUDA device with triton installed, or any device when ``TRITON_INTERPRET=1``
    (the interpreter runs on CPU tensors, slowly: tests only).
    """
    if importlib.util.find_spec("triton") is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return str(device).startswith("cuda")


def __getattr__(name: str):
    mod = _TRITON_FUNCS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
