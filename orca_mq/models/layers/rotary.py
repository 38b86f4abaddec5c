"""Rotary position embedding tables for every scaling transformers knows (default, linear, dynamic NTK,
llama3, yarn, longrope), as transformers computes them, in the rotate-half layout the kernels take:
[positions, head_dim] cos and sin with equal halves, yarn's and longrope's attention factor folded in.

A partial rotary (Phi: the first `rotary_dim` dims of a head rotate) is run as a whole-head one: the
loader permutes each q and k head's dims so the rotated pairs sit where rotate-half pairs them
(`partial_order`) and the other dims get frequency 0 (cos 1, sin 0). q . k is the same under one
permutation of both, so attention and every kernel are unchanged.

Dynamic NTK and longrope depend on the sequence's length too (transformers recomputes the tables per
forward from its longest position): their tables are made per iteration from each token's request
length (`Rotary.tables`), others once.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from orca_mq.models.info import RopeSpec

if TYPE_CHECKING:
    from orca_mq.engine.attention import AttentionMetadata

Tensor = torch.Tensor


def inv_freq(spec: RopeSpec, dim: int, seq_len: int = 0) -> tuple[Tensor, float]:
    """(inverse frequencies [dim / 2], attention factor) of a rotary over `dim` dims, for a sequence of
    `seq_len` tokens where the kind depends on it."""
    p, base = spec.params, spec.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    kind = spec.kind
    if kind in ("default", "linear"):
        return 1.0 / (base ** exponents) / (p["factor"] if kind == "linear" else 1.0), 1.0
    if kind == "dynamic":
        max_pos = p["max_position_embeddings"]
        n = max(seq_len, max_pos)
        base = base * ((p["factor"] * n / max_pos) - (p["factor"] - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents), 1.0
    if kind == "llama3":
        return _llama3(1.0 / (base ** exponents), p), 1.0
    if kind == "freq_factors":   # llama.cpp's form of llama3 scaling: a divisor per frequency
        return 1.0 / (base ** exponents) / torch.tensor(p["factors"], dtype=torch.float32), 1.0
    if kind == "yarn":
        return _yarn(base, dim, p)
    if kind == "longrope":
        original = p["original_max_position_embeddings"]
        factor = p.get("factor") or p["max_position_embeddings"] / original
        attention = p.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = torch.tensor(p["long_factor"] if seq_len > original else p["short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base ** exponents), attention
    raise ValueError(f"rope scaling {kind!r} not supported (default, linear, dynamic, llama3, yarn, longrope)")


def _llama3(freq: Tensor, p: dict) -> Tensor:
    factor, low, high, old = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old / low, freq / factor, freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, p: dict) -> tuple[Tensor, float]:
    factor, original = p["factor"], p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        attention = (mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
                     if p.get("mscale") and p.get("mscale_all_dim") else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    freq = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return freq, float(attention)


def partial_order(head_dim: int, rotary_dim: int) -> Tensor:
    """The permutation of a head's dims that puts a partial rotary's pairs (i, i + rotary_dim / 2) at
    rotate-half's (j, j + head_dim / 2), the dims that do not rotate after each half's rotated ones."""
    half, r = head_dim // 2, rotary_dim // 2
    order = torch.empty(head_dim, dtype=torch.int64)
    order[:r] = torch.arange(r)                                  # first halves of the rotated pairs
    order[half: half + r] = torch.arange(r, 2 * r)               # their second halves
    rest = torch.arange(2 * r, head_dim)
    order[r:half] = rest[: half - r]
    order[half + r:] = rest[half - r:]
    return order


class Rotary:
    """One rotary's tables over a head of `head_dim` (the first `rotary_dim` of which rotate)."""

    def __init__(self, spec: RopeSpec, head_dim: int, rotary_dim: int, max_len: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.spec, self.head_dim, self.rotary_dim = spec, head_dim, rotary_dim
        self.device, self.dtype = device, dtype
        self.by_length = spec.by_length
        self.cos, self.sin = self._tables(torch.arange(max_len, dtype=torch.float32), max_len)

    def _tables(self, positions: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        freq, attention = inv_freq(self.spec, self.rotary_dim, seq_len)
        emb = torch.outer(positions, freq)
        cos, sin = emb.cos() * attention, emb.sin() * attention
        pad = self.head_dim // 2 - freq.numel()     # partial rotary: the dims that do not turn (cos 1, sin 0)
        if pad:
            cos = torch.cat([cos, cos.new_ones(len(positions), pad)], dim=-1)
            sin = torch.cat([sin, sin.new_zeros(len(positions), pad)], dim=-1)
        return torch.cat([cos, cos], dim=-1).to(self.device, self.dtype), torch.cat([sin, sin], dim=-1).to(self.device, self.dtype)

    def tables(self, meta: "AttentionMetadata") -> tuple[Tensor, Tensor, Tensor]:
        """(cos, sin, the row of each token in them): the whole tables and the positions, or for a
        length-dependent kind the iteration's own rows, each token's from its attention row's length
        (its request's, but where a token is a row alone: deterministic mode, a verify row on the CPU)."""
        if not self.by_length:
            return self.cos, self.sin, meta.positions
        lengths = torch.repeat_interleave(meta.seq_lens.long().cpu(), meta.cu_q_lens.long().cpu().diff())
        pos = meta.positions.cpu().float()
        cos = torch.empty(len(pos), self.head_dim, device=self.device, dtype=self.dtype)
        sin = torch.empty_like(cos)
        for n in torch.unique(lengths).tolist():   # one table row set per distinct length
            rows = (lengths == n).nonzero().squeeze(1)
            c, s = self._tables(pos[rows], int(n))
            at = rows.to(self.device)
            cos[at], sin[at] = c, s
        return cos, sin, torch.arange(len(pos), device=self.device)
