"""Attention backends behind one interface (base.AttentionBackend), registered by name:
`torch` (any device), `cpu` (C++ paged decode kernel), `triton` (CUDA). `resolve()` picks one."""
from __future__ import annotations

from orca_mq.engine.attention import cpu, torch_backend, triton  # noqa: F401  (each registers its backend)
from orca_mq.engine.attention.base import BACKENDS, AttentionBackend, BackendUnavailable, resolve
from orca_mq.engine.attention.metadata import AttentionMetadata, AttentionSpec

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "AttentionSpec", "BackendUnavailable", "resolve"]
