"""Token sampling on the last stage: greedy, temperature, top-k, top-p, per-request seed.

A seeded request draws from a generator seeded by (seed, position), so its tokens do not depend
on which other requests share the batch, on preemption, or on which process samples.
"""
from __future__ import annotations

import torch

from orca_mq.protocol.iteration import SeqWork

Tensor = torch.Tensor


def sample(logits: Tensor, seqs: list[SeqWork]) -> list[int]:
    """logits [B, vocab] (row b belongs to seqs[b]) -> one token id per request."""
    tokens = logits.argmax(dim=-1)
    rows = [b for b, s in enumerate(seqs) if not (s.temperature == 0 or s.top_k == 1)]
    if rows:
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
    return tokens.tolist()


def _filtered_probs(logits: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
        drop = ranks[None, :] >= k[:, None]
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        p = torch.tensor(top_p, device=logits.device, dtype=cum.dtype)
        drop |= (cum - sorted_logits.softmax(dim=-1)) >= p[:, None]  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)
