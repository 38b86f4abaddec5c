"""The one interface every attention backend implements, a registry by name, and `resolve()`.

Selective batching's one request-aware operation is attention; everything else sees the iteration
as one flattened [T, hidden] tensor. A backend writes the iteration's new K/V into the paged cache
and attends every request over its own KV. Which one runs is decided here, once per stage, from
`engine.attention_backend`, the device, the dtype and what this machine can build.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar, Protocol, TypeVar

import torch

from orca_mq.engine.attention.metadata import AttentionMetadata, AttentionSpec
from orca_mq.engine.layer_ops import LayerOps

Tensor = torch.Tensor
log = logging.getLogger(__name__)


class BackendUnavailable(RuntimeError):
    """This backend cannot run on this device/dtype/machine (the message says why)."""


class AttentionBackend(Protocol):
    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]]   # device types `auto` may pick it for
    split_decode: ClassVar[bool]         # it reads the metadata's decode_* fields (one-token rows apart from prompts)
    fused_rotary_kv: ClassVar[bool]      # it has rotary_write_kv: Llama's rotary and the KV write in one kernel
    ops: LayerOps   # the model's norms, rotary and activation on this backend's device (engine/layer_ops.py)

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype) -> "AttentionBackend":
        """The backend for this device and dtype; raises BackendUnavailable when it cannot run."""
        ...

    def write_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> None:
        """k/v [T, kvh, d] of the iteration's new tokens into their cache slots (in place)."""
        ...

    def attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
               meta: AttentionMetadata, spec: AttentionSpec) -> Tensor:
        """q [T, H, d] over each request's KV (this iteration's already written) -> [T, H, d], masked,
        scaled, capped and sunk as the layer's spec says."""
        ...

    def rotary_write_kv(self, qkv: Tensor, meta: AttentionMetadata, k_cache: Tensor, v_cache: Tensor, cos: Tensor,
                        sin: Tensor, n_heads: int, positions: Tensor) -> Tensor:
        """(fused_rotary_kv backends) Rotate the Q and K heads of a fused QKV output [T, (H + 2 kvh) d] in
        place by the table rows `positions`, write K and V into their slots; the rotated Q [T, H, d]."""
        ...


B = TypeVar("B", bound=type)
BACKENDS: dict[str, type[AttentionBackend]] = {}
AUTO_ORDER = ("triton", "cpu", "torch")   # fastest first: fused kernels, then the C++ decode kernel


def register(name: str) -> Callable[[B], B]:
    def add(cls: B) -> B:
        BACKENDS[name] = cls  # type: ignore[assignment]
        return cls
    return add


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """`name`'s backend (an error if it cannot run), or for `auto` the first of AUTO_ORDER that
    serves this device type and can run here."""
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"engine.attention_backend must be auto | {' | '.join(BACKENDS)}, got {name!r}")
        return BACKENDS[name].create(device, dtype)
    for candidate in AUTO_ORDER:
        cls = BACKENDS[candidate]
        if device.type not in cls.devices:
            continue
        try:
            backend = cls.create(device, dtype)
        except BackendUnavailable as e:
            log.warning("attention backend %s unavailable: %s", candidate, e)
            continue
        log.info("attention backend: %s (%s, %s)", candidate, device.type, dtype)
        return backend
    raise BackendUnavailable(f"no attention backend for {device} {dtype}")
