"""What identifies a full KV block for prefix caching: a hash chained over its tokens and its
predecessor's hash, seeded with what else changes K/V (the model, its dtype), as vLLM's automatic
prefix caching does. Two requests whose first n blocks of tokens agree have the same n hashes, so
the K/V of those blocks is the same and one copy can serve both.

The hash is BLAKE2b (128 bits) over the predecessor's digest and the block's token ids: a
collision would let one prompt read another's K/V, so it must be infeasible to construct, not
only unlikely by chance (Python's own hash() of a tuple is neither).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


def chain_seed(*identity: str) -> bytes:
    """The hash before the first block: everything besides the tokens that changes K/V."""
    return hashlib.blake2b("\x00".join(identity).encode(), digest_size=DIGEST_BYTES).digest()


def extend_chain(hashes: list[bytes], tokens: Sequence[int], block_size: int, n_blocks: int, seed: bytes,
                 offset: int = 0) -> list[bytes]:
    """Append to `hashes` (the chain of the first len(hashes) blocks) the hashes of the blocks up to
    `n_blocks` (full blocks only) of the token ids `tokens`, which start at position `offset` (at most
    the first new block's); returns `hashes`."""
    first, end = len(hashes), min(n_blocks, (offset + len(tokens)) // block_size)
    if end <= first:
        return hashes
    prev = hashes[-1] if hashes else seed
    data = memoryview(array("q", tokens[first * block_size - offset:end * block_size - offset]).tobytes())
    step = 8 * block_size
    for j in range(end - first):
        prev = block_hash(prev, data[j * step:(j + 1) * step])
        hashes.append(prev)
    return hashes


def block_hash(prev: bytes, tokens: bytes | memoryview) -> bytes:
    """The hash of a block of token ids (int64, `array("q")`'s bytes) after its predecessor's hash `prev`."""
    return hashlib.blake2b(prev + tokens, digest_size=DIGEST_BYTES).digest()
