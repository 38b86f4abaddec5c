"""The torch path with the C++ kernels of kernels/cpu_kernels.py: increment requests on the paged
decode kernel, which reads each request's KV blocks in place instead of gathering them, and the
layer's norms, rotary and activation one pass each (engine/layer_ops.py); float32 or bfloat16."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

from orca_mq.engine.attention.base import BackendUnavailable, register
from orca_mq.engine.attention.metadata import AttentionMetadata, AttentionSpec
from orca_mq.engine.attention.torch_backend import TorchAttention
from orca_mq.engine.layer_ops import CpuOps, LayerOps

Tensor = torch.Tensor
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@register("cpu")
@dataclass(slots=True)
class CpuAttention(TorchAttention):
    name: ClassVar[str] = "cpu"
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    ext: ModuleType
    ops: LayerOps

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype) -> "CpuAttention":
        if device.type != "cpu" or dtype not in KERNEL_DTYPES:
            raise BackendUnavailable(f"the CPU kernels need a cpu device and float32 or bfloat16, got {device} {dtype}")
        from kernels import cpu_kernels

        ext = cpu_kernels.load()
        if ext is None:
            raise BackendUnavailable("the CPU kernels cannot be built here (see the log)")
        return cls(ext, CpuOps(ext))

    def decode(self, qd: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, spec: AttentionSpec) -> Tensor:
        return self.ext.paged_decode_attention(qd, k_cache, v_cache, meta.decode_blocks, meta.decode_lens, spec.scale,
                                               spec.window, spec.softcap, spec.sinks)
