"""Embedding requests: their pooling parameters and how a pooled vector is made and travels.

An embedding request is a prompt whose rows sample nothing: the last stage returns, per prompt chunk,
the sum of the final norm's output (transformers' `last_hidden_state`; no LM head) over the chunk's
tokens that pool (every one for "mean", the prompt's last for "last"), in float32; the scheduler adds
the chunks up and, when the prompt's last chunk comes back, divides by the count and L2-normalises
(`finish`). The vector travels as little-endian float32 bytes (hidden_size x 4 of them), never as a
list of Python floats.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, get_args

import numpy as np

from orca_mq.config import Pooling
from orca_mq.errors import InvalidRequest
from orca_mq.short_repr import short_repr

POOLINGS: tuple[str, ...] = get_args(Pooling)
F32 = np.dtype("<f4")
NORM_EPS = 1e-12   # torch.nn.functional.normalize's: a zero vector stays zero


@dataclass(slots=True)
class PoolingParams:
    """How an embedding request's prompt becomes one vector."""

    pooling: str | None = None   # "last" (the last token's row: decoder LMs as embedders) | "mean"; None: model.pooling
    normalize: bool = True       # L2-normalised (then a dot product is the cosine similarity)

    def validate(self) -> None:
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise InvalidRequest(f"pooling must be one of {', '.join(POOLINGS)}, got {short_repr(self.pooling)}", "pooling")
        if not isinstance(self.normalize, bool):
            raise InvalidRequest(f"normalize must be a boolean, got {short_repr(self.normalize)}", "normalize")

    def resolved(self, default: str) -> "PoolingParams":
        """Validated, with the server's default pooling where none is given."""
        self.validate()
        return PoolingParams(self.pooling or default, self.normalize)

    @property
    def mean(self) -> bool:
        return self.pooling == "mean"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "PoolingParams":
        if not isinstance(data, dict):
            raise InvalidRequest(f"pooling parameters must be a map, got {short_repr(data)}", "pooling")
        if unknown := set(data) - set(cls.__dataclass_fields__):
            raise InvalidRequest(f"unknown pooling parameter(s) {short_repr(sorted(map(str, unknown)))}", "pooling")
        return cls(**data)


def finish(total: np.ndarray, count: int, normalize: bool) -> bytes:
    """A request's pooled vector from the sum of its pooled rows (`total`, float64) and their count:
    the mean, L2-normalised when asked, as little-endian float32 bytes."""
    v = total / max(count, 1)
    if normalize:
        v = v / max(float(np.linalg.norm(v)), NORM_EPS)
    return v.astype(F32).tobytes()


def floats(data: bytes) -> list[float]:
    """A vector's bytes as Python floats (float32 values)."""
    return np.frombuffer(data, F32).tolist()
