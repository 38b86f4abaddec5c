"""The KV pool sized from the device's memory (`engine.n_slots = 0` on CUDA), as vLLM's
`gpu_memory_utilization` sizes it:

    KV bytes = utilization x total - in use (weights and buffers, CUDA context and others)
               - peak activations (one forward at the token budget, profiled) - CUDA graphs

and the pool is that over one block's bytes, less the scratch block. Every worker measures its own
stage; the smallest figure wins (workers/data_plane.py agree_min) and the launcher passes it to the
scheduler and the frontend before they start, so none of them can disagree (kv/pool.py). On the CPU
the pool stays as configured (`n_slots = 0` is AUTO_CPU_SLOTS there): host memory is not profiled.

`DeviceMemory` is where the figures come from: torch's CUDA allocator and driver on a GPU. Tests
replace it through FAKE_ENV (a device of a fixed size, nothing of which this process holds), so
the workers' measure, agreement and the launcher's hand-over run in real processes on the CPU.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from orca_mq.kv.pool import FAKE_ENV

if TYPE_CHECKING:
    from orca_mq.config import Config

# "TOTAL:USED0,USED1,...": each stage's device holds TOTAL bytes, USEDi of them by others (tests only)
GiB = float(1 << 30)


class DeviceMemory(Protocol):
    def info(self) -> tuple[int, int]:
        """(free, total) bytes of the whole device, whoever holds them."""
        ...

    def allocated(self) -> int:
        """Bytes this process's tensors hold now."""
        ...

    def peak(self) -> int:
        """The most `allocated` was since the last reset_peak."""
        ...

    def reserved(self) -> int:
        """Bytes this process's allocator holds (tensors and its cache)."""
        ...

    def reset_peak(self) -> None: ...

    def release(self) -> None:
        """Return the allocator's cache to the device."""
        ...


@dataclass(frozen=True, slots=True)
class CudaMemory:
    device: torch.device

    def info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass(frozen=True, slots=True)
class FixedMemory:
    """A device of `total` bytes, `used` of them held by others, none by this process (FAKE_ENV)."""

    total: int
    used: int

    def info(self) -> tuple[int, int]:
        return self.total - self.used, self.total

    def allocated(self) -> int:
        return 0

    def peak(self) -> int:
        return 0

    def reserved(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def release(self) -> None:
        pass


def fake_memory(stage: int) -> FixedMemory | None:
    if not (spec := os.environ.get(FAKE_ENV)):
        return None
    total, _, used = spec.partition(":")
    per_stage = [int(u) for u in used.split(",")]
    return FixedMemory(int(total), per_stage[min(stage, len(per_stage) - 1)])


def memory_source(cfg: "Config", device: torch.device, stage: int) -> DeviceMemory | None:
    """Where a stage's worker reads its device's memory, or None: the pool is the config's."""
    if cfg.engine.n_slots:
        return None
    if (fake := fake_memory(stage)) is not None:
        return fake
    return CudaMemory(device) if device.type == "cuda" else None


@dataclass(frozen=True, slots=True)
class KVSizing:
    """One stage's terms, in bytes; `blocks` is what they leave it, `agreed` what every stage got."""

    total: int            # the device's memory
    utilization: float    # engine.gpu_memory_utilization
    weights: int          # what this process's allocator holds after the profile: weights and buffers
    other: int            # in use beyond it: the CUDA context, NCCL, cuBLAS, other processes
    activations: int      # the peak of one forward (and sampling) at the token budget, beyond what it started on
    graphs: int           # the CUDA graphs' buffers and memory pool (captured in the profile, then again on the pool)
    block_bytes: int      # K and V of one block of tokens, every layer of the stage (and their fp8 scales)
    block_size: int
    agreed: int = 0       # blocks of the pool every stage allocated (the smallest stage's)

    @property
    def kv_bytes(self) -> int:
        return int(self.utilization * self.total) - self.weights - self.other - self.activations - self.graphs

    @property
    def blocks(self) -> int:
        """Blocks the terms leave this stage, less the scratch block padding rows write to."""
        return max(0, self.kv_bytes // self.block_bytes - 1)

    def describe(self) -> str:
        gib = {k: getattr(self, k) / GiB for k in ("total", "weights", "other", "activations", "graphs", "kv_bytes")}
        return (f"{self.utilization:g} x {gib['total']:.2f} GiB - weights and buffers {gib['weights']:.2f} - "
                f"other {gib['other']:.2f} - activations {gib['activations']:.2f} - CUDA graphs {gib['graphs']:.2f} "
                f"= {gib['kv_bytes']:.2f} GiB of KV at {self.block_bytes / self.block_size / 1024:.1f} KiB a slot: "
                f"{self.blocks * self.block_size} slots" + (f" (every stage: {self.agreed * self.block_size})"
                                                            if self.agreed and self.agreed != self.blocks else ""))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"kv_bytes": self.kv_bytes, "blocks": self.blocks, "slots": self.agreed * self.block_size}


def check_fits(sizing: KVSizing, max_model_len: int) -> None:
    """A pool that cannot hold one request of the model's whole context is refused (one line)."""
    need = -(-max_model_len // sizing.block_size)
    if sizing.agreed < need:
        raise ValueError(f"the KV pool sized from the device's memory holds {sizing.agreed * sizing.block_size} slots, "
                         f"less than one model.max_model_len = {max_model_len} request: raise "
                         "engine.gpu_memory_utilization, lower model.max_model_len or scheduler.max_num_batched_tokens, "
                         f"or set engine.n_slots ({sizing.describe()})")
