"""Token sampling on the last stage: one batched step for every row of an iteration.

A row (one request) is greedy or sampled (temperature, top-k, top-p), and may carry an allowed-token
bitmask (a structured output's grammar state, computed by the scheduler): a masked token is never
chosen. Sampling is inverse-CDF with one uniform per row. A seeded request's uniform is a hash of
(seed, position), so its tokens depend only on its own logits: never on the batch, on preemption
or on which process samples. An unseeded row draws its uniform from this process's generator.

One request's failure stays its own: a row whose logits are not finite (a fault upstream, or a
failed stage that sent NaN on), whose mask is malformed or allows no token, or whose sampling
raises is reported as failed, and the other rows keep their tokens.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from orca_mq.protocol.iteration import SeqWork, mask_bytes

Tensor = torch.Tensor
_MASK64 = (1 << 64) - 1
_unseeded = random.Random()  # seeded from the OS
CANDIDATES = 256             # top-k / top-p first look at each row's 256 most likely tokens


def sample(logits: Tensor, seqs: list[SeqWork]) -> tuple[list[int], list[int]]:
    """logits [B, vocab] (row b belongs to seqs[b]) -> (one token id per request, failed rows)."""
    ok = torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))   # NaN propagates
    logits, usable = _apply_masks(logits.float(), seqs)
    ok = (ok & usable).tolist()
    failed = [b for b, good in enumerate(ok) if not good]
    tokens = logits.argmax(dim=-1)
    rows = [b for b, s in enumerate(seqs) if ok[b] and not (s.temperature == 0 or s.top_k == 1)]
    try:
        _sample_rows(logits, seqs, rows, tokens)
    except Exception:  # a vectorized step failed: redo row by row to find whose parameters it was
        for b in rows:
            try:
                _sample_rows(logits, seqs, [b], tokens)
            except Exception:
                failed.append(b)
    return tokens.tolist(), sorted(failed)


def uniform(seed: int, position: int) -> float:
    """A number in (0, 1) that depends only on (seed, position): splitmix64 of the pair, 53 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (((z ^ (z >> 31)) >> 11) + 0.5) / (1 << 53)


def _apply_masks(logits: Tensor, seqs: list[SeqWork]) -> tuple[Tensor, Tensor]:
    """-inf where a row's bitmask forbids a token; and which rows are usable (a well-formed mask
    that allows at least one token, or none). The bits are unpacked on the host (numpy: a
    little-endian word's bits are its bytes' bits, least significant first) into one allowed map,
    free rows all allowed, applied in one `where`: a few torch ops whatever the batch, not a
    few per row (each costs a thread-team barrier on a busy CPU)."""
    if all(s.allowed_token_bitmask is None for s in seqs):
        return logits, torch.ones(len(seqs), dtype=torch.bool, device=logits.device)
    vocab = logits.shape[-1]
    size = mask_bytes(vocab)
    packed = np.full((len(seqs), size), 0xFF, dtype=np.uint8)
    for b, s in enumerate(seqs):
        m = s.allowed_token_bitmask
        if m is not None:
            packed[b] = np.frombuffer(m, dtype=np.uint8) if len(m) == size else 0  # malformed: allows nothing
    allowed = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab].view(np.bool_)
    usable = torch.from_numpy(allowed.any(axis=1)).to(logits.device)
    return torch.where(torch.from_numpy(allowed).to(logits.device), logits, float("-inf")), usable


def _sample_rows(logits: Tensor, seqs: list[SeqWork], rows: list[int], tokens: Tensor) -> None:
    """Rows without top-k / top-p sample over the vocabulary in token order; the others over their
    kept candidates, most likely first."""
    plain = [b for b in rows if seqs[b].top_k <= 0 and seqs[b].top_p >= 1.0]
    filtered = [b for b in rows if b not in plain]
    for group in (plain, filtered):
        if not group:
            continue
        dev = logits.device
        idx = torch.tensor(group, device=dev)
        temps = torch.tensor([seqs[b].temperature for b in group], device=dev, dtype=torch.float32)
        probs = (logits.index_select(0, idx) / temps[:, None]).softmax(dim=-1)
        ids = None
        if group is filtered:
            probs, ids = _candidates(probs, [seqs[b].top_k for b in group], [seqs[b].top_p for b in group])
        cum = probs.cumsum(dim=-1)
        total = cum[:, -1:]
        if not bool((total > 0).all()):   # NaN or nothing left: the per-row retry names the row
            raise FloatingPointError("no token has a positive probability")
        u = torch.tensor([uniform(s.seed, s.seq_len) if (s := seqs[b]).seed is not None
                          else (_unseeded.getrandbits(53) + 0.5) / (1 << 53) for b in group], device=dev)
        # the first token whose cumulative probability exceeds u * total (< total): adding a token of
        # probability 0 leaves the sum unchanged, so such a token is never chosen
        target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
        chosen = torch.searchsorted(cum, target, right=True)
        tokens[idx] = chosen.squeeze(1) if ids is None else ids.gather(1, chosen).squeeze(1)


def _candidates(probs: Tensor, top_k: list[int], top_p: list[float]) -> tuple[Tensor, Tensor]:
    """Each row's kept tokens under top-k / top-p, most likely first (0 for the dropped), and their
    ids. They come from a partial top-k of CANDIDATES, widened only while a row's nucleus reaches past
    them: a whole-vocabulary sort costs 75 ms at 32 x 49,152 on 2 cores, the top 256 about 4 ms."""
    vocab = probs.shape[-1]
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=probs.device)
    p = torch.tensor(top_p, device=probs.device, dtype=probs.dtype)
    width = min(vocab, max(CANDIDATES, *top_k))
    while True:
        kept, ids = probs.topk(width, dim=-1)
        # settled: top-k cuts inside the candidates, or their mass reaches top_p
        if width == vocab or bool(((k < vocab) | (kept.sum(dim=-1) >= p)).all()):
            break
        width = min(vocab, width * 16)
    ranks = torch.arange(width, device=probs.device)
    drop = (ranks[None, :] >= k[:, None]) | (kept.cumsum(dim=-1) - kept >= p[:, None])   # the smallest prefix reaching top_p
    drop[:, 0] = False   # the most likely token always stays, whatever p rounds to in float32
    return kept.masked_fill(drop, 0.0), ids
