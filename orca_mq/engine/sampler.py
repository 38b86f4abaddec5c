"""Token sampling on the last stage: one batched step for every row of an iteration, on the device (on the CPU,
the extension's fused step: kernels/csrc/sample_cpu.cpp; the ops below where it cannot be built).

A row (one request) is greedy or sampled (temperature, then min-p, top-k and top-p, each over what the one
before kept: vLLM's order), and may carry an allowed-token bitmask (a structured output's grammar state,
computed by the scheduler): a masked token is never chosen; and logits processors (logit_bias, min_tokens'
bans, the penalties: orca_mq/engine/history.py), applied after the mask. Sampling is inverse-CDF over the
kept tokens in token order, with one uniform per row. A seeded request's uniform is a hash of
(seed, position), so its tokens depend only on its own logits: never on the batch, on preemption
or on which process samples. An unseeded row draws its uniform from this process's generator.

The tokens stay on the device (the next iteration may read them there: async scheduling), with a
flag per row; the caller copies both back in one copy. An iteration of greedy rows never waits for
the device here; one with sampled rows does (their candidate sets and checks).

One request's failure stays its own: a row whose logits are not finite (a fault upstream, or a
failed stage that sent NaN on), whose mask is malformed or allows no token, or whose sampling
raises is reported as failed, and the other rows keep their tokens.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kernels import cpu_kernels
from orca_mq.engine.history import Processors, TokenHistory
from orca_mq.protocol.iteration import IterationPlan, PlanArrays, SeqWork, mask_bytes, pack
from orca_mq.protocol.sampling_fields import is_greedy

Tensor = torch.Tensor
_MASK64 = (1 << 64) - 1
_unseeded = random.Random()  # seeded from the OS
CANDIDATES = 256             # a device's top-k / top-p first look at each row's 256 largest logits


@dataclass(slots=True)
class SamplingRows:
    """The sampling parameters of an iteration's sampled positions, in logit-row order: a row's last
    token, or each of a verify row's last draft + 1 (speculative decoding)."""

    plan_rows: np.ndarray     # int64, the plan row of each
    temperature: np.ndarray   # float32
    top_k: np.ndarray         # int32
    top_p: np.ndarray         # float32
    seeds: np.ndarray         # int64, -1: unseeded
    seq_lens: np.ndarray      # int64, the position a row's uniform is drawn for (a verify row's: each token's own)
    masks: dict[int, bytes]   # row -> allowed-token bitmask
    processors: Processors | None = None   # None: no row has any (what every other iteration costs)

    @classmethod
    def of(cls, a: PlanArrays) -> "SamplingRows":
        rows, at = a.sampled_positions()
        first = {int(rows[i]): int(i) for i in np.flatnonzero(at == 0)}
        masks, seen = {}, {}
        for r, m in zip(a.mask_rows.tolist(), a.plan.masks):   # a verify row's masks: its positions', in order
            if r in first:
                masks[first[r] + seen.get(r, 0)] = m
                seen[r] = seen.get(r, 0) + 1
        # a seeded verify row draws, for each token it samples after, the uniform a decode there would:
        # with a draft of single tokens, sampling each position and keeping the drafts that agree is
        # rejection sampling (accept a draft token with its probability, else draw from the rest), and
        # a seeded request's tokens are the same with speculation on and off
        seq_lens = (a.start_pos.astype(np.int64) + a.q_lens)[rows]
        if a.drafts is not None:
            seq_lens += at - a.drafts[rows]
        return cls(rows, a.temperature[rows], a.top_k[rows], a.top_p[rows], a.seeds[rows], seq_lens, masks,
                   Processors.of(a, rows))

    def filtered(self) -> np.ndarray:
        """Whether each row's top-k / top-p may cut its tokens (a top-p that is not a number fails it there)."""
        return (self.top_k > 0) | ~(self.top_p >= 1.0)

    def __len__(self) -> int:
        return len(self.temperature)


@dataclass(slots=True)
class Sampled:
    tokens: Tensor      # [S] int64 on the logits' device
    ok: Tensor          # [S] bool: finite logits and a usable mask
    failed: list[int]   # rows whose sampling raised
    back: Tensor        # [2, >= S] int64, tokens over ok: what the caller copies back (one copy)


def greedy(logits: Tensor) -> Tensor:
    """Every row's most likely token over whether its logits are all finite (NaN or inf: a fault
    upstream), [2, S] int64: the whole step of a greedy row, also run inside a decode CUDA graph."""
    if logits.device.type == "cpu":   # the CPU's argmax is scalar for 16-bit floats (2.7 ms at 32 x 49,152 in
        logits = logits.float()       # bfloat16; widened first, 0.06 + 0.55), and a widened value is the same value
    # a row's max and min are finite iff all of it is (both propagate NaN): two vectorized reductions, where
    # isfinite().all() builds a bool tensor first (0.57 ms against 0.04 at 16 x 49,152 on the CPU)
    return torch.stack((logits.argmax(dim=-1), (logits.amax(dim=-1).isfinite() & logits.amin(dim=-1).isfinite()).long()))


def sample(logits: Tensor, rows: SamplingRows, first: Tensor | None = None, history: TokenHistory | None = None) -> Sampled:
    """logits [S, vocab], row b belonging to rows[b]; `first`: greedy(logits) already computed (by a
    CUDA graph; it may have more columns, for a bucket's padding rows); `history`: the penalized
    requests' token histories (the last stage's; without it no penalty applies), which the sampled
    tokens join. `logits` is left as it is (the raw logits, for log probabilities)."""
    drawn = np.flatnonzero(~is_greedy(rows.temperature, rows.top_k))
    kernel = cpu_kernels.load() if first is None and logits.device.type == "cpu" else None
    if kernel is not None:
        return _sample_fused(kernel, logits, rows, drawn, history)
    first = greedy(logits) if first is None else first
    tokens, ok = first[0, :len(rows)], first[1, :len(rows)].bool()
    procs = rows.processors
    if not rows.masks and not len(drawn) and procs is None:   # greedy rows only: nothing here waits for the device
        return Sampled(tokens, ok, [], first)
    logits = logits.float()
    if rows.masks:
        logits, usable = _apply_masks(logits, rows.masks)
        ok = ok & usable
    if procs is not None:   # greedy rows with processors alone wait for nothing either
        logits = procs.apply(logits, history)
        ok = ok & ~(logits.isnan() | logits.isposinf()).any(dim=-1)   # a malformed plan's bias or penalty
    tokens = logits.argmax(dim=-1) if rows.masks or procs is not None else tokens.clone()
    good = ok.tolist() if len(drawn) else []
    failed = _draw(logits, rows, [int(b) for b in drawn if good[b]], tokens)
    if procs is not None:
        procs.record(history, tokens)
    return Sampled(tokens, ok, failed, torch.stack((tokens, ok.long())))


def _sample_fused(kernel: ModuleType, logits: Tensor, rows: SamplingRows, drawn: np.ndarray,
                  history: TokenHistory | None) -> Sampled:
    """The CPU's step: the extension's sample_rows takes each row's finiteness, mask, argmax and draw in a few
    passes over the row in cache (top-k and top-p by a radix select, where a sort took 4 ms a row at 49,152)."""
    raw = logits.float().contiguous()
    x, masks, procs = raw, rows.masks, rows.processors
    if procs is not None:
        if masks and procs.bans():   # a ban is undone where it leaves nothing the mask allows: the masks go first
            x, masks = _apply_masks(x, masks)[0], {}   # (a row left all -inf is not usable to the kernel either)
        x = procs.apply(x, history, kernel)   # biases and penalties leave -inf where it was: they commute with a mask
    n = len(rows)
    u = np.full(n, -1.0)
    u[drawn] = _uniforms(rows, drawn.tolist())
    index = np.full(n, -1, np.int64)
    index[list(masks)] = np.arange(len(masks))
    min_p = np.zeros(n, np.float32) if procs is None else procs.min_p

    def column(values: np.ndarray, dtype: type) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype))

    back = kernel.sample_rows(raw, x, _packed(masks, logits.shape[1]), torch.from_numpy(index),
                              column(rows.temperature, np.float32), column(min_p, np.float32),
                              column(rows.top_k, np.int64), column(rows.top_p, np.float32), torch.from_numpy(u))
    tokens, ok = back[0], back[1].bool()
    if procs is not None:
        procs.record(history, tokens)
    return Sampled(tokens, ok, [], back)


def _draw(logits: Tensor, rows: SamplingRows, group: list[int], tokens: Tensor) -> list[int]:
    """Draws the group's tokens into `tokens`; the rows whose sampling raised."""
    if not group:
        return []
    try:
        _sample_rows(logits, rows, group, tokens)
        return []
    except Exception:  # a vectorized step failed: redo row by row to find whose parameters it was
        failed = []
        for b in group:
            try:
                _sample_rows(logits, rows, [b], tokens)
            except Exception:
                failed.append(b)
        return failed


def failed_rows(ok: list[bool], raised: list[int]) -> list[int]:
    """Rows that end with an error: not `ok` on the device, or whose sampling raised."""
    return sorted(set(raised) | {b for b, good in enumerate(ok) if not good})


def sample_seqs(logits: Tensor, seqs: list[SeqWork]) -> tuple[list[int], list[int]]:
    """The step for rows given as SeqWork, synchronously: (a token per row, failed rows). For engines
    that make their own logits (the schedulers' test engines)."""
    every = [dataclasses.replace(s, sample=True) for s in seqs]   # row b is seqs[b]'s, whether it samples or not
    drawn = sample(logits, SamplingRows.of(pack(IterationPlan(0, every)).arrays()))
    return drawn.tokens.tolist(), failed_rows(drawn.ok.tolist(), drawn.failed)


def uniform(seed: int, position: int) -> float:
    """A number in (0, 1) that depends only on (seed, position): splitmix64 of the pair, 53 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (((z ^ (z >> 31)) >> 11) + 0.5) / (1 << 53)


def _apply_masks(logits: Tensor, masks: dict[int, bytes]) -> tuple[Tensor, Tensor]:
    """-inf where a row's bitmask forbids a token; and which rows are usable (a well-formed mask that
    allows at least one token, or none). On a device the packed words go in one copy and are unpacked
    there (a little-endian word's bits are its bytes' bits, least significant first); on the CPU numpy
    unpacks them in one pass. The mask is added, 0 or -inf (1 - 1/bit): exact, and vectorized where
    torch.where on a bool mask is not (1.8 ms against 0.2 at 16 x 49,152 on the CPU)."""
    n, vocab = logits.shape
    packed = np.full((n, mask_bytes(vocab)), 0xFF, dtype=np.uint8)
    for b, m in masks.items():
        packed[b] = _mask_row(m, vocab)
    if logits.device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(packed, axis=1, count=vocab, bitorder="little"))
    else:
        words = torch.from_numpy(packed).to(logits.device, non_blocking=True)
        shifts = torch.arange(8, device=logits.device, dtype=torch.uint8)
        bits = ((words[:, :, None] >> shifts) & 1).view(n, size * 8)[:, :vocab]
    return logits + bits.float().reciprocal_().neg_().add_(1), bits.amax(dim=-1).bool()


def _mask_row(mask: bytes, vocab: int) -> np.ndarray | int:
    size = mask_bytes(vocab)
    return np.frombuffer(mask, dtype=np.uint8) if len(mask) == size else 0  # malformed: allows nothing


def _packed(masks: dict[int, bytes], vocab: int) -> Tensor:
    """The masks' rows in the dict's order, [M, mask_bytes(vocab)] uint8."""
    packed = np.empty((len(masks), mask_bytes(vocab)), dtype=np.uint8)
    for i, m in enumerate(masks.values()):
        packed[i] = _mask_row(m, vocab)
    return torch.from_numpy(packed)


def _uniforms(rows: SamplingRows, group: list[int]) -> list[float]:
    """Each row's uniform: a seeded row's of (seed, position), an unseeded row's from this process's generator."""
    return [uniform(int(rows.seeds[b]), int(rows.seq_lens[b])) if rows.seeds[b] >= 0
            else (_unseeded.getrandbits(53) + 0.5) / (1 << 53) for b in group]


def _sample_rows(logits: Tensor, rows: SamplingRows, group: list[int], tokens: Tensor) -> None:
    """Draws the group's rows over the vocabulary in token order, what top-k / top-p drop left out (_cut)."""
    if not (rows.temperature[group] > 0).all():   # a malformed plan's (NaN too): the row fails, as in the extension
        raise ValueError("a drawn row's temperature must be positive")
    dev = logits.device
    idx = torch.tensor(group, device=dev)
    temps = torch.from_numpy(rows.temperature[group]).to(dev)
    x = logits.index_select(0, idx)
    probs = (x / temps[:, None]).softmax(dim=-1)
    if rows.processors is not None and rows.processors.min_p[group].any():   # vLLM's min-p, after the temperature
        min_p = torch.from_numpy(rows.processors.min_p[group]).to(dev)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    at = np.flatnonzero(rows.filtered()[group])
    if len(at) == len(group):   # the cuts are on the logits before the temperature, which may round two to one
        probs = _cut(x, probs, rows.top_k[group], rows.top_p[group])
    elif len(at):
        of = np.asarray(group)[at]
        where = torch.from_numpy(at).to(dev)
        probs = probs.index_copy(0, where, _cut(x.index_select(0, where), probs.index_select(0, where),
                                                 rows.top_k[of], rows.top_p[of]))
    cum = probs.cumsum(dim=-1)
    total = cum[:, -1:]
    if not bool((total > 0).all()):   # NaN or nothing left: the per-row retry names the row
        raise FloatingPointError("no token has a positive probability")
    u = torch.tensor(_uniforms(rows, group), device=dev)
    # the first token whose cumulative probability exceeds u * total (< total): adding a token of
    # probability 0 leaves the sum unchanged, so such a token is never chosen
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens[idx] = torch.searchsorted(cum, target, right=True).squeeze(1)


def _cut(x: Tensor, probs: Tensor, top_k: np.ndarray, top_p: np.ndarray) -> Tensor:
    """`probs` (of the logits `x`, before the temperature) with what top-k, then top-p over what top-k kept,
    drop set to 0 (vLLM's and transformers' order and renormalization), as cuts on the logits so that equal
    logits share a fate: the k largest and any equal to the k-th; then the largest whose probabilities reach
    top_p of theirs, and any equal to the last. The cuts come from a partial top-k of CANDIDATES logits,
    widened only while a row's nucleus reaches past them (a whole-vocabulary sort took 4 ms a row at 49,152 on
    2 cores; the CPU's extension selects by radix instead: kernels/csrc/sample_cpu.cpp)."""
    if np.isnan(top_p).any():   # the row fails, as in the extension (a top-p of 0, as float32 rounds the API's
        raise ValueError("top_p is not a number")   # least, keeps the most likely token)
    dev, vocab = x.device, x.shape[-1]
    cuts = (top_k > 0) & (top_k < vocab)
    k = torch.from_numpy(np.where(cuts, top_k, 1).astype(np.int64)).to(dev)[:, None]
    p = torch.from_numpy(top_p.astype(np.float64)).to(dev)[:, None]
    cut = torch.from_numpy(cuts).to(dev)[:, None]
    whole = probs.sum(dim=-1, keepdim=True, dtype=torch.float64) if (~cuts & (top_p < 1)).any() else None
    width = min(vocab, max([CANDIDATES, *top_k[cuts].tolist()]))   # where every row's k-th is
    while True:
        xs, order = x.topk(width, dim=-1)
        least = torch.where(cut, xs.gather(1, k - 1), float("-inf"))
        cum = probs.gather(1, order).double().masked_fill(xs < least, 0.0).cumsum(dim=-1)
        # settled where all that top-k keeps is among the candidates (equal logits may run past them), and
        # top-p's share of it too
        total = cum[:, -1:] if whole is None else torch.where(cut, cum[:, -1:], whole)
        settled = (~cut | (xs[:, -1:] < least) | least.isneginf()) & ((p >= 1) | (cum[:, -1:] >= p * total))
        if width == vocab or bool(settled.all()):
            break
        width = min(vocab, width * 16)
    reach = torch.searchsorted(cum, p * total).clamp_(max=width - 1)
    least = torch.where(p < 1, xs.gather(1, reach), least)
    return probs.masked_fill(x < least, 0.0)
