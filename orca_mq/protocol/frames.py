"""A message of many rows sent as as many frames as it takes to stay within MAX_FRAME_BYTES.

A receiver refuses a larger frame (codec.unpack), so one that grew past the bound, e.g. many
long prompts' log probabilities finishing in one iteration, would be dropped with every token and
final it held. Rows are independent (a request's rows keep their order), so the rows are halved
until each part fits. One row alone always fits: admission bounds what a request's row can hold
(orca_mq.admission.limits.fit, its prompt's log probabilities).

Beside that bound, a frame carries at most FRAME_ENTRIES tokens and log probabilities (`spans`): a
receiver decodes a frame in one turn of its event loop, so many held requests' finals with their log
probabilities arriving together (orca_mq.server.held_rows) go as frames of ~10 ms each to decode, the
loop free between them, not as one of 10 MB. A row alone may carry more.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orca_mq.protocol import codec
from orca_mq.protocol.codec import PROTOCOL_VERSION, encode


FRAME_ENTRIES = 1 << 14   # tokens and log probabilities a frame carries at most (a row alone may carry more)


class FrameTooLarge(ValueError):
    """One row over the bound: admission should have refused its request."""


def frames(build: Callable[[int, int], Any], n: int, version: int = PROTOCOL_VERSION) -> list[bytes]:
    """The message of rows [0, n) (`build(lo, hi)` makes the one of rows lo..hi-1), encoded: one frame
    when it fits the bound (codec.MAX_FRAME_BYTES), else its halves', in order."""
    parts: list[bytes] = []
    _split(build, 0, n, version, codec.MAX_FRAME_BYTES, parts)
    return parts


def spans(weights: list[int], limit: int | None = None) -> list[tuple[int, int]]:
    """Consecutive ranges [lo, hi) of rows whose weights add up to at most `limit` (FRAME_ENTRIES by
    default; a heavier row alone)."""
    limit = FRAME_ENTRIES if limit is None else limit
    if sum(weights) <= limit:   # most iterations: one frame, no walk
        return [(0, len(weights))] if weights else []
    out, lo, held = [], 0, 0
    for i, w in enumerate(weights):
        if i > lo and held + w > limit:
            out.append((lo, i))
            lo, held = i, 0
        held += w
    if lo < len(weights):
        out.append((lo, len(weights)))
    return out


def _split(build: Callable[[int, int], Any], lo: int, hi: int, version: int, limit: int, out: list[bytes]) -> None:
    frame = encode(build(lo, hi), version)
    if len(frame) <= limit:
        out.append(frame)
        return
    if hi - lo == 1:
        raise FrameTooLarge(f"one row of {len(frame)} bytes exceeds a frame's {limit}")
    mid = (lo + hi) // 2
    _split(build, lo, mid, version, limit, out)
    _split(build, mid, hi, version, limit, out)
