"""Token sampling on the last stage: greedy, temperature, top-k, top-p, per-request seed.

A seeded request draws from a generator seeded by (seed, position), so its tokens do not depend
on which other requests share the batch, on preemption, or on which process samples.

One request's failure stays its own: a row whose logits are not finite (a fault upstream, or
a failed stage that sent NaN on) or whose sampling raises is reported as failed, and the other
rows keep their tokens.
"""
from __future__ import annotations

import torch

from orca_mq.protocol.iteration import SeqWork

Tensor = torch.Tensor


def sample(logits: Tensor, seqs: list[SeqWork]) -> tuple[list[int], list[int]]:
    """logits [B, vocab] (row b belongs to seqs[b]) -> (one token id per request, failed rows)."""
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    failed = [b for b, ok in enumerate(finite) if not ok]
    tokens = logits.argmax(dim=-1)
    rows = [b for b, s in enumerate(seqs) if finite[b] and not (s.temperature == 0 or s.top_k == 1)]
    try:
        _sample_rows(logits, seqs, rows, tokens)
    except Exception:  # a vectorized step failed: redo row by row to find whose parameters it was
        for b in rows:
            try:
                _sample_rows(logits, seqs, [b], tokens)
            except Exception:
                failed.append(b)
    return tokens.tolist(), sorted(failed)


def _sample_rows(logits: Tensor, seqs: list[SeqWork], rows: list[int], tokens: Tensor) -> None:
    if not rows:
        return
    idx = torch.tensor(rows, device=logits.device)
    temps = torch.tensor([seqs[b].temperature for b in rows], device=logits.device, dtype=torch.float32)
    probs = _filtered_probs(logits.index_select(0, idx).float() / temps[:, None],
                            [seqs[b].top_k for b in rows], [seqs[b].top_p for b in rows])
    for j, b in enumerate(rows):
        s = seqs[b]
        gen = None
        if s.seed is not None:
            gen = torch.Generator(device=logits.device).manual_seed((s.seed * 1_000_003 + s.seq_len) % (1 << 63))
        # exponential race: argmax(p / E) with E ~ Exp(1) samples from p, one vectorized draw
        noise = torch.empty_like(probs[j]).exponential_(generator=gen)
        tokens[b] = (probs[j] / noise).argmax()


def _filtered_probs(logits: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=logits.device)
        drop = ranks[None, :] >= k[:, None]
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        p = torch.tensor(top_p, device=logits.device, dtype=cum.dtype)
        drop |= (cum - sorted_logits.softmax(dim=-1)) >= p[:, None]  # keep the smallest prefix reaching top_p
        drop[:, 0] = False  # the most likely token always stays, whatever p rounds to in float32
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)
