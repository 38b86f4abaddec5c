"""The Triton kernels of kernels/ (CUDA; on the CPU only under TRITON_INTERPRET=1, for tests):
one launch covers the whole iteration, and the model's norms and rotary use the fused kernels too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from orca_mq.engine.attention.base import BackendUnavailable, register
from orca_mq.engine.attention.metadata import AttentionMetadata, AttentionSpec
from orca_mq.engine.layer_ops import LayerOps, TritonOps

Tensor = torch.Tensor


@register("triton")
@dataclass(slots=True)
class TritonAttention:
    name: ClassVar[str] = "triton"
    devices: ClassVar[tuple[str, ...]] = ("cuda",)
    split_decode: ClassVar[bool] = False   # one ragged launch for every row
    fused_rotary_kv: ClassVar[bool] = True
    ops: LayerOps   # the Triton rms_norm and rotary for the model's other ops
    split_kv: bool = True   # one-token rows may split long contexts over programs (not batch-invariant: off in deterministic mode)

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype) -> "TritonAttention":
        import kernels  # imports no triton until a kernel is used

        if not kernels.triton_usable(device):
            raise BackendUnavailable(f"Triton kernels cannot run on {device} (no triton, or a CPU without TRITON_INTERPRET=1)")
        return cls(TritonOps(kernels))

    def write_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> None:
        from kernels.kv_write_kernel import write_kv

        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def rotary_write_kv(self, qkv: Tensor, meta: AttentionMetadata, k_cache: Tensor, v_cache: Tensor, cos: Tensor,
                        sin: Tensor, n_heads: int, positions: Tensor) -> Tensor:
        from kernels.rotary_kv_kernel import rotary_write_kv

        return rotary_write_kv(qkv, positions, cos, sin, meta.slot_mapping, k_cache, v_cache, n_heads, k_cache.shape[2])

    def attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
               meta: AttentionMetadata, spec: AttentionSpec) -> Tensor:
        """k/v are unused: this iteration's are already in the cache."""
        from kernels import split_kv_kernel
        from kernels.attention_kernel import ragged_paged_attention

        if self.split_kv and meta.decode_tiles is not False and (out := split_kv_kernel.decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, spec.scale, window=spec.window,
                softcap=spec.softcap, sinks=spec.sinks)) is not None:
            return out
        return ragged_paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_q_lens, meta.seq_lens, spec.scale,
                                      meta.decode_tiles, spec.window, spec.softcap, spec.sinks)
