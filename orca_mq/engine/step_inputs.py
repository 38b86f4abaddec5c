"""An iteration's inputs, built once: the seam between a plan and the kernels.

From the plan's columns (orca_mq.protocol.iteration.PlanArrays) every per-token and per-row input
is derived with array arithmetic on the host, no Python per row: token ids, positions, KV slots,
the attention rows (cu_q_lens, seq_lens, block tables), the LM head's rows, and where async
scheduling planned a row before its token came back, which row of the previous iteration's sampled
tokens fills it. They are written into one byte buffer (`Layout`: one segment per field) and reach
the device in one copy, from pinned memory and non-blocking on CUDA; the model reads views of it.

A decode-only iteration may be padded to a CUDA-graph bucket (orca_mq/engine/graphs.py): the same
fields, laid out for the largest bucket in a static buffer the graphs were captured on. Padding
rows write their K/V to a scratch block past the pool's blocks and read only it, so they touch no
request's KV. Verify rows of speculative decoding (a request's last token and its draft, a logit per
token) fit the same layout: `logit_rows` names every token that samples; where the backend runs
one-token rows apart (the CPU's decode kernel), each verify token is an attention row of its own over
its KV up to itself, as deterministic mode runs every token; elsewhere (Triton, CUDA graphs' mixed
buckets) a verify row is a short chunk, one attention row.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from orca_mq.engine.attention.metadata import AttentionMetadata
from orca_mq.protocol.iteration import PlanArrays

Tensor = torch.Tensor
ALIGN = 16   # bytes: every segment starts aligned for any element type
I32, I64 = np.dtype("<i4"), np.dtype("<i8")
TORCH = {I32: torch.int32, I64: torch.int64}


class Layout:
    """Named segments of one byte buffer: (name, dtype, shape), each aligned for any element type."""

    __slots__ = ("segments", "offsets", "nbytes")

    def __init__(self, segments: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]) -> None:
        self.segments = segments
        self.offsets: dict[str, int] = {}
        at = 0
        for name, dtype, shape in segments:
            self.offsets[name] = at
            at += -(-(dtype.itemsize * int(np.prod(shape))) // ALIGN) * ALIGN
        self.nbytes = at

    def through(self, name: str, rows: int) -> int:
        """Bytes from the buffer's start to the end of segment `name`'s first `rows` rows."""
        _, dtype, shape = next(seg for seg in self.segments if seg[0] == name)
        return self.offsets[name] + rows * dtype.itemsize * int(np.prod(shape[1:]))

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        at = self.offsets
        return {n: buf[at[n]: at[n] + d.itemsize * int(np.prod(s))].view(d).reshape(s) for n, d, s in self.segments}

    def device_views(self, buf: Tensor) -> dict[str, Tensor]:
        at = self.offsets
        return {n: buf[at[n]: at[n] + d.itemsize * int(np.prod(s))].view(TORCH[d]).view(s) for n, d, s in self.segments}


@functools.lru_cache(maxsize=256)
def layout(tokens: int, rows: int, width: int, logits: int, fills: int, decode_rows: int, cached: int) -> Layout:
    """The block tables last: a bucket's copy stops after its own rows of them (the largest segment)."""
    return Layout((
        ("token_ids", I64, (tokens,)), ("positions", I64, (tokens,)), ("slot_mapping", I64, (tokens,)),
        ("cu_q_lens", I32, (rows + 1,)), ("seq_lens", I32, (rows,)), ("logit_rows", I64, (logits,)),
        ("fill_dst", I64, (fills,)), ("fill_src", I64, (fills,)), ("decode_tokens", I64, (decode_rows,)),
        ("decode_lens", I32, (decode_rows,)), ("prefill_cached", I64, (cached,)),
        ("decode_blocks", I64, (decode_rows, width)), ("block_tables", I32, (rows, width)),
    ))


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the inputs are checked against and shaped by (one per stage)."""

    block_size: int
    num_blocks: int          # the pool's blocks; block `num_blocks` is the padding rows' scratch block
    vocab_size: int
    max_len: int             # positions must stay below it (the rotary tables)
    token_rows: bool         # deterministic mode: every new token its own attention row
    split_decode: bool       # the backend runs one-token rows apart from prompts (torch, cpu)


@dataclass(slots=True)
class HostStep:
    """One iteration's inputs on the host, before they are laid out."""

    fields: dict[str, np.ndarray]
    prefills: list[tuple[int, int, int]]   # (first token row, q_len, start_pos) of each multi-token row
    cached_counts: list[int]               # cached positions of each prefill (their slots in prefill_cached)
    num_tokens: int
    decode_only: bool                      # one token per row, every row samples: a CUDA graph may run it
    block_size: int

    @classmethod
    def empty(cls, block_size: int, width: int) -> "HostStep":
        """No rows: what a bucket's padding is laid out from."""
        z, z2 = np.zeros(0, np.int64), np.zeros((0, width), np.int64)
        fields = {n: z for n in ("token_ids", "positions", "slot_mapping", "seq_lens", "logit_rows", "fill_dst",
                                 "fill_src", "decode_tokens", "decode_lens", "prefill_cached")}
        fields |= {"cu_q_lens": np.zeros(1, np.int64), "block_tables": z2, "decode_blocks": z2}
        return cls(fields, [], [], 0, False, block_size)

    @classmethod
    def filler(cls, tokens: int, rows: int, block_size: int, width: int, scratch_block: int) -> "HostStep":
        """`tokens` tokens over `rows` rows, all on the scratch block: valid inputs of a mixed bucket's
        shape to capture its graph on (its padding alone would need a row per token)."""
        q = np.full(rows, tokens // rows, np.int64)
        q[: tokens % rows] += 1
        row_start = np.cumsum(q) - q
        positions = np.arange(tokens) - np.repeat(row_start, q)
        tables = np.zeros((rows, width), np.int64)
        tables[np.arange(width) < -(-q // block_size)[:, None]] = scratch_block
        z, z2 = np.zeros(0, np.int64), np.zeros((0, width), np.int64)
        fields = {"token_ids": np.zeros(tokens, np.int64), "positions": positions,
                  "slot_mapping": scratch_block * block_size + positions % block_size,
                  "cu_q_lens": np.concatenate(([0], np.cumsum(q))), "seq_lens": q, "block_tables": tables,
                  "logit_rows": z, "fill_dst": z, "fill_src": z, "decode_tokens": z, "decode_lens": z,
                  "decode_blocks": z2, "prefill_cached": z}
        return cls(fields, [], [], tokens, False, block_size)

    @property
    def width(self) -> int:
        return self.fields["block_tables"].shape[1]

    def layout(self) -> Layout:
        """Its own layout (an eager iteration's: no padding)."""
        f = self.fields
        return layout(len(f["token_ids"]), len(f["seq_lens"]), self.width, len(f["logit_rows"]), len(f["fill_dst"]),
                      len(f["decode_tokens"]), len(f["prefill_cached"]))


def build(a: PlanArrays, g: Geometry) -> HostStep:
    """Every input of the iteration, checked against the model and the pool (ValueError: the plan
    cannot run; the iteration's requests fail, nothing else)."""
    q, start = a.q_lens.astype(np.int64), a.start_pos.astype(np.int64)
    s, t = len(q), int(q.sum())
    seq_len = start + q
    row_start = np.cumsum(q) - q
    row_of = np.repeat(np.arange(s), q)
    positions = np.arange(t) - row_start[row_of] + start[row_of]
    if t and int(seq_len.max()) > g.max_len:
        raise ValueError(f"a row reaches position {int(seq_len.max())}, beyond the model's {g.max_len}")
    if (a.table_lens.astype(np.int64) * g.block_size < seq_len).any():
        raise ValueError("a row's block table cannot hold its tokens")
    if len(a.tables) and (int(a.tables.min()) < 0 or int(a.tables.max()) >= g.num_blocks):
        raise ValueError(f"a block id outside the pool's {g.num_blocks} blocks")
    filled = a.prev_rows >= 0
    tokens = a.token_ids.astype(np.int64)
    tokens[row_start[filled]] = 0   # placeholders: the previous iteration's tokens land here on the device
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= g.vocab_size):
        raise ValueError(f"a token id outside the vocabulary of {g.vocab_size}")
    width = max(int(a.table_lens.max()) if s else 1, 1)
    tables = np.zeros((s, width), np.int64)
    tables[np.arange(width) < a.table_lens[:, None]] = a.tables
    slots = tables[row_of, positions // g.block_size] * g.block_size + positions % g.block_size
    # rows whose tokens each attend alone, over their KV up to themselves: every row in deterministic
    # mode, verify rows on the decode path (all K/V of a layer is written before its attention reads any)
    own = np.full(s, g.token_rows) | (a.drafts > 0 if a.drafts is not None and g.split_decode else False)
    attn_q = np.where(own, 1, q)
    attn_rows = np.repeat(np.arange(s), np.where(own, q, 1))        # the plan row of each attention row
    cu = np.concatenate(([0], np.cumsum(attn_q[attn_rows])))
    kv_lens = positions[cu[:-1]] + attn_q[attn_rows] if t else np.zeros(0, np.int64)
    logit_rows, at = a.sampled_positions()
    drafts = a.drafts[logit_rows] if a.drafts is not None else 0
    fields = {"token_ids": tokens, "positions": positions, "slot_mapping": slots, "cu_q_lens": cu,
              "seq_lens": kv_lens, "block_tables": tables[attn_rows],
              "logit_rows": (row_start + q - 1)[logit_rows] - drafts + at,
              "fill_dst": row_start[filled], "fill_src": a.prev_rows[filled].astype(np.int64)}
    prefills: list[tuple[int, int, int]] = []
    cached_counts: list[int] = []
    cached = np.zeros(0, np.int64)
    if g.split_decode:
        one = (own | (q == 1))[row_of]   # the tokens that are an attention row alone
        fields |= {"decode_tokens": np.flatnonzero(one), "decode_blocks": tables[row_of[one]],
                   "decode_lens": positions[one] + 1}
        multi = np.flatnonzero((q > 1) & ~own)
        prefills = [(int(row_start[r]), int(q[r]), int(start[r])) for r in multi]
        cached_counts = [p for _, _, p in prefills]
        pos = np.concatenate([np.arange(p) for p in cached_counts]) if cached_counts else np.zeros(0, np.int64)
        owner = np.repeat(multi, cached_counts) if cached_counts else np.zeros(0, np.int64)
        cached = tables[owner, pos // g.block_size] * g.block_size + pos % g.block_size
    else:
        fields |= {"decode_tokens": np.zeros(0, np.int64), "decode_blocks": np.zeros((0, width), np.int64),
                   "decode_lens": np.zeros(0, np.int64)}
    fields["prefill_cached"] = cached
    decode_only = bool(s) and t == s and bool(a.sample.all())
    return HostStep(fields, prefills, cached_counts, t, decode_only, g.block_size)


@dataclass(frozen=True, slots=True)
class Bucket:
    """A CUDA graph's shape, what a step is padded to: its tokens, attention rows and LM-head rows,
    and the attention tiles it was captured with (one-token rows, or prompt chunks)."""

    tokens: int
    rows: int
    logits: int
    decode_tiles: bool


def write(step: HostStep, lay: Layout, buf: np.ndarray, scratch_block: int, bucket: Bucket | None = None) -> None:
    """Lay `step` out in `buf`, padded to `bucket` (default: the step's own shape). Padding tokens
    are each a one-token row that reads and writes only the scratch block and attends over one key;
    rows past them are empty (no tokens, no keys); padding LM-head rows read token 0."""
    v = lay.host_views(buf)
    f = step.fields
    t, b = len(f["token_ids"]), len(f["seq_lens"])
    pad = 0 if bucket is None else bucket.tokens - t
    rows = b + pad if bucket is None else bucket.rows
    for name in ("token_ids", "positions", "slot_mapping", "fill_dst", "fill_src", "prefill_cached"):
        v[name][:len(f[name])] = f[name]
    v["token_ids"][t:t + pad] = 0
    v["positions"][t:t + pad] = 0
    v["slot_mapping"][t:t + pad] = scratch_block * step.block_size
    v["cu_q_lens"][:b + 1] = f["cu_q_lens"]
    v["cu_q_lens"][b + 1:b + 1 + pad] = t + np.arange(1, pad + 1)
    v["cu_q_lens"][b + 1 + pad:rows + 1] = t + pad
    v["seq_lens"][:b] = f["seq_lens"]
    v["seq_lens"][b:b + pad] = 1
    v["seq_lens"][b + pad:rows] = 0
    _table_rows(v["block_tables"][:rows], f["block_tables"], pad, scratch_block)
    s = len(f["logit_rows"])
    v["logit_rows"][:s] = f["logit_rows"]
    v["logit_rows"][s:None if bucket is None else bucket.logits] = 0
    if len(v["decode_tokens"]):   # the torch and cpu paths (not captured): padding tokens are decode rows
        d = len(f["decode_tokens"])
        v["decode_tokens"][:d] = f["decode_tokens"]
        v["decode_tokens"][d:d + pad] = np.arange(t, t + pad)
        v["decode_lens"][:d] = f["decode_lens"]
        v["decode_lens"][d:d + pad] = 1
        _table_rows(v["decode_blocks"][:d + pad], f["decode_blocks"], pad, scratch_block)


def _table_rows(dst: np.ndarray, src: np.ndarray, pad: int, scratch_block: int) -> None:
    """The rows' tables, then `pad` rows of the scratch block alone, then empty rows."""
    n, w = src.shape
    dst[:n, :w] = src
    dst[:n, w:] = 0
    dst[n:] = 0
    dst[n:n + pad, 0] = scratch_block


@dataclass(slots=True)
class DeviceStep:
    """An iteration's inputs as views of a device buffer."""

    meta: AttentionMetadata
    token_ids: Tensor       # [T] (a bucket's: [bucket.tokens])
    fill_dst: Tensor        # [P] token rows whose id is the previous iteration's sampled token...
    fill_src: Tensor        # [P] ...of its sampling row fill_src


def metadata(step: HostStep, lay: Layout, buf: Tensor, bucket: Bucket | None = None) -> DeviceStep:
    """Views of the device buffer `lay` describes; with `bucket`, its leading part of a layout laid
    out for the largest bucket (a CUDA graph reads these same views at every replay)."""
    v = lay.device_views(buf)
    f = step.fields
    decode_tiles = None   # the kernel's own choice from the shape, unless padding hides the real one
    if bucket is not None:
        n = {"token_ids": bucket.tokens, "positions": bucket.tokens, "slot_mapping": bucket.tokens,
             "cu_q_lens": bucket.rows + 1, "seq_lens": bucket.rows, "block_tables": bucket.rows,
             "logit_rows": bucket.logits, "decode_tokens": bucket.rows, "decode_blocks": bucket.rows,
             "decode_lens": bucket.rows}
        v = {name: x[:n[name]] if name in n else x for name, x in v.items()}
        decode_tiles = bucket.decode_tiles
    slots, at = [], 0
    for c in step.cached_counts:
        slots.append(v["prefill_cached"][at: at + c] if c else None)
        at += c
    meta = AttentionMetadata(
        positions=v["positions"], slot_mapping=v["slot_mapping"], cu_q_lens=v["cu_q_lens"], seq_lens=v["seq_lens"],
        block_tables=v["block_tables"], logit_rows=v["logit_rows"], decode_tokens=v["decode_tokens"],
        decode_blocks=v["decode_blocks"], decode_lens=v["decode_lens"], prefills=step.prefills, prefill_slots=slots,
        decode_tiles=decode_tiles)
    p = len(f["fill_dst"])
    return DeviceStep(meta, v["token_ids"], v["fill_dst"][:p], v["fill_src"][:p])
