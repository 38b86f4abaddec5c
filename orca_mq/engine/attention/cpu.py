"""The torch path with the increment requests on the C++ paged decode kernel (kernels/cpu_decode.py),
which reads each request's KV blocks in place instead of gathering them: float32 or bfloat16."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from orca_mq.engine.attention.base import BackendUnavailable, register
from orca_mq.engine.attention.metadata import AttentionMetadata
from orca_mq.engine.attention.torch_backend import TorchAttention

if TYPE_CHECKING:
    from kernels.cpu_decode import PagedDecode

Tensor = torch.Tensor
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@register("cpu")
@dataclass(slots=True)
class CpuAttention(TorchAttention):
    name: ClassVar[str] = "cpu"
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    kernel: "PagedDecode"

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype) -> "CpuAttention":
        if device.type != "cpu" or dtype not in KERNEL_DTYPES:
            raise BackendUnavailable(f"the CPU decode kernel needs a cpu device and float32 or bfloat16, got {device} {dtype}")
        from kernels import cpu_decode

        kernel = cpu_decode.load()
        if kernel is None:
            raise BackendUnavailable("the CPU decode kernel cannot be built here (see the log)")
        return cls(kernel)

    def decode(self, qd: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        return self.kernel(qd, k_cache, v_cache, meta.decode_blocks, meta.decode_lens, scale)
