"""Selective-batching kernels: Triton versions and their plain-torch references.

    from kernels import write_kv, ragged_paged_attention, rms_norm, fused_add_rms_norm, rotary
    from kernels import write_kv_ref, ragged_paged_attention_ref, rms_norm_ref, ...

The reference functions (``kernels.reference``) are imported eagerly and never
import triton. The Triton functions are imported lazily on first attribute
access, so ``import kernels`` does not import triton: that matters because
``TRITON_INTERPRET=1`` (needed to run the kernels on CPU tensors) only takes
effect if it is set before triton is first imported. On CPU without the
interpreter use the ``*_ref`` functions (or the engine's own torch path).

``rotary`` is out of place (returns new tensors); ``write_kv`` is in place.
``write_kv_for_engine`` / ``attention_for_engine`` adapt the two attention-path
kernels to the engine's calling convention (see orca_mq/model.py).
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
    write_kv_ref,
)

_TRITON_FUNCS = {
    "write_kv": ".kv_write_kernel",
    "ragged_paged_attention": ".attention_kernel",
    "rms_norm": ".norm_rope_kernel",
    "fused_add_rms_norm": ".norm_rope_kernel",
    "rotary": ".norm_rope_kernel",
}

__all__ = [
    "write_kv",
    "ragged_paged_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary",
    "write_kv_ref",
    "ragged_paged_attention_ref",
    "rms_norm_ref",
    "fused_add_rms_norm_ref",
    "rotary_ref",
    "triton_usable",
    "write_kv_for_engine",
    "attention_for_engine",
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


# Adapters with the engine's calling convention (orca_mq/model.py, attention_backend="triton"):
# same signatures as orca_mq.engine.attention.write_kv_torch / attention_torch. ``meta`` is the
# iteration's AttentionMetadata (slot_mapping, block_tables, cu_q_lens, seq_lens on the device).


def write_kv_for_engine(k, v, k_cache, v_cache, meta) -> None:
    """Write this iteration's K/V ``[T, kvh, d]`` into the layer's paged cache (in place)."""
    from .kv_write_kernel import write_kv

    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)


def attention_for_engine(q, k, v, k_cache, v_cache, meta, scale: float):
    """One launch for the whole iteration; ``k``/``v`` are unused (already in the cache)."""
    from .attention_kernel import ragged_paged_attention

    return ragged_paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_q_lens, meta.seq_lens, scale)


def __getattr__(name: str):
    mod = _TRITON_FUNCS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
