"""The allowed-token bitmasks of an iteration's constrained rows, computed in one batched call
(llguidance's executor, without the GIL) into one buffer, each narrowed by its grammar (the budget's
closing, the digit bound), then one `bytes` per row for its SeqWork (format:
orca_mq.protocol.iteration.mask_bytes)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from orca_mq.protocol.iteration import MASK_WORD_BITS, SeqWork, mask_bytes

if TYPE_CHECKING:
    from orca_mq.structured.grammar import Grammar


def fill_masks(seqs: list[SeqWork], grammars: list["Grammar | None"]) -> None:
    """Set `allowed_token_bitmask` of each row whose grammar is given (None: a free row, or one
    that samples nothing this iteration)."""
    rows = [(i, g) for i, g in enumerate(grammars) if g is not None and g.matcher is not None]
    if not rows:
        return
    vocab = rows[0][1].vocab
    size = mask_bytes(vocab.size)
    buf = np.zeros((len(rows), size * 8 // MASK_WORD_BITS), dtype=np.int32)
    vocab.executor.unsafe_compute_mask_ptr([(g.matcher, k) for k, (_, g) in enumerate(rows)],
                                           buf.ctypes.data, size, len(rows))
    for k, (_, g) in enumerate(rows):
        g.narrow(buf[k])
    data = buf.tobytes()
    for k, (i, _) in enumerate(rows):
        seqs[i].allowed_token_bitmask = data[k * size:(k + 1) * size]
