"""The columnar planner (issue 42): the steady-state decode iteration planned and applied in columns.

At a large batch nearly every iteration is all decode rows: each running request feeds its last token
and samples one. Planning those through a SeqWork per row and packing them again costs the scheduler
more CPU per token than the engine on a small model. Here such an iteration is built straight into the
plan's columns (PackedPlan) from a per-request column store by slot (sampling parameters, token count,
last token, block table), and its result's tokens are counted, published to the prefix cache and checked
for stops with array arithmetic. Only the state the policies read stays on the Request (its tokens,
in_flight, planned, sample_row), written in one pass each way.

A request decodes in columns when nothing of it needs a row of its own: no grammar, logits
processors, log probabilities, pooling or speculation (the scheduler has no speculator), and a model
without sliding windows (whose tables have holes). An iteration whose rows are all such requests in
INCREMENT is planned here whole (`plan_decode`); in any other iteration such rows are gathered here
(`decode_rows`) and merged in plan order with the general path's plan of the rest (`merge`). Either way
their tokens are applied here (`apply_decode`) and streamed as columns (the plan's ids, the result's
tokens), the rest's row by row. The plans are what the general path alone gives, byte for byte, and each
request's tokens and finals the same (tests/test_sched_columns.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from orca_mq.kv.block_manager import BlockManager
from orca_mq.protocol.iteration import F32, I32, I64, NO_ROW, U8, IterationPlan, PackedPlan
from orca_mq.sched.events import TokenColumns, TokenEvent
from orca_mq.sched.request import Phase, Request

if TYPE_CHECKING:
    from orca_mq.sched.base import Scheduler

GROW = 256   # slots added when the store is full


@dataclass(slots=True)
class Steady:
    """An all-decode batch as the store planned it: what its next plans share while the same requests
    decode in the same order (their ids and slots, the columns that do not change: one token fed and
    sampled per row, the sampling parameters)."""
    batch: list[Request]   # a copy: the policy's list is its own
    ended: int             # Scheduler.ended when it was planned
    ids: list[str]         # every plan of it, its record and its token columns share this list: never written
    slots: np.ndarray
    fixed: dict[str, bytes] = field(default_factory=dict)


@dataclass(slots=True)
class DecodeColumns:
    """The column store: each columnar request's sampling parameters and stop conditions, by its slot."""

    eos: np.ndarray   # the model's EOS token ids
    temperature: np.ndarray = field(default_factory=lambda: np.zeros(0, F32))
    top_k: np.ndarray = field(default_factory=lambda: np.zeros(0, I32))
    top_p: np.ndarray = field(default_factory=lambda: np.zeros(0, F32))
    seed: np.ndarray = field(default_factory=lambda: np.zeros(0, I64))
    max_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    eos_stops: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))   # EOS ends it (not ignore_eos)
    own_stops: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))   # it has stop_token_ids of its own
    # each slot's request as its rows need it, kept here so a plan and its result read no Request: tokens it
    # has (prompt + output), its last token and its prompt's length (written where a token is appended: here and
    # in Scheduler._apply_rows)
    n_tok: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    n_prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    free: list[int] = field(default_factory=list)
    # each slot's copy of its block table (a plan gathers the batch's from here, not from Python lists): the
    # block manager's list it copies and that list's length then (0: none copied); a decode row's table only
    # grows (no window, no speculation) by the blocks its positions need, or is another list after the request's
    # KV went to the host and came back (`forget`)
    tab: np.ndarray = field(default_factory=lambda: np.zeros((0, 16), I32))
    tab_ref: list[list[int] | None] = field(default_factory=list)
    tab_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    steady: Steady | None = None   # the last all-decode batch planned here

    def kept(self, batch: list[Request], ended: int) -> Steady | None:
        """The last all-decode batch when `batch` is the same requests in the same order and none ended
        since (so each is still a plain decode: a request leaves INCREMENT only by ending)."""
        s = self.steady
        return s if s is not None and s.ended == ended and s.batch == batch else None

    def add(self, req: Request) -> None:
        """Give the request a slot when it can decode in columns (req.slot stays -1 otherwise)."""
        p = req.params
        if (req.grammar is not None or req.pooling is not None or p.processed or p.logprobs is not None
                or p.prompt_logprobs is not None):
            return
        if not self.free:
            self._grow()
        s = req.slot = self.free.pop()
        self.temperature[s], self.top_k[s], self.top_p[s] = p.temperature, p.top_k, p.top_p
        self.seed[s] = -1 if p.seed is None else p.seed
        self.max_tokens[s], self.eos_stops[s], self.own_stops[s] = p.max_tokens, not p.ignore_eos, bool(p.stop_token_ids)
        self.n_prompt[s] = len(req.prompt_token_ids)
        self.appended(req)

    def appended(self, req: Request) -> None:
        """Its tokens as they are now (a token appended outside `apply_decode`)."""
        self.n_tok[req.slot], self.last[req.slot] = req.num_tokens, (req.output_token_ids or req.prompt_token_ids)[-1]

    def forget(self, req: Request) -> None:
        """Its block table is another list now (its KV came back from the host): copy it whole when next planned."""
        if req.slot >= 0:
            self.tab_ref[req.slot], self.tab_len[req.slot] = None, 0

    def remove(self, req: Request) -> None:
        if req.slot >= 0:
            self.free.append(req.slot)
            self.tab_ref[req.slot], self.tab_len[req.slot] = None, 0
            req.slot = -1

    def copy_table(self, s: int, table: list[int]) -> None:
        """Slot s's copy of `table` brought up to date: the blocks appended since, or all of them when the
        block manager holds another list for the request."""
        have, n = int(self.tab_len[s]) if self.tab_ref[s] is table else 0, len(table)
        if n > self.tab.shape[1]:
            wider = np.zeros((len(self.tab), max(n, 2 * self.tab.shape[1])), I32)
            wider[:, :self.tab.shape[1]] = self.tab
            self.tab = wider
        if n == have + 1:   # a decode row's table grows a block at a time: a scalar store, 4x a slice's speed
            self.tab[s, have] = table[have]
        else:
            self.tab[s, have:n] = table[have:]
        self.tab_ref[s], self.tab_len[s] = table, n

    def tables(self, slots: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """The slots' first `lens` blocks, end to end (their tables chained)."""
        starts = np.cumsum(lens) - lens
        at = np.repeat(slots * self.tab.shape[1] - starts, lens) + np.arange(int(lens.sum()))
        return self.tab.ravel()[at]

    def _grow(self) -> None:
        n = len(self.temperature)
        for name in ("temperature", "top_k", "top_p", "seed", "max_tokens", "eos_stops", "own_stops", "n_tok", "last",
                     "n_prompt", "tab_len"):
            old = getattr(self, name)
            setattr(self, name, np.concatenate([old, np.zeros(GROW, old.dtype)]))
        self.tab = np.concatenate([self.tab, np.zeros((GROW, self.tab.shape[1]), I32)])
        self.tab_ref.extend([None] * GROW)
        self.free.extend(range(n + GROW - 1, n - 1, -1))   # popped lowest first


def decoding(r: Request) -> bool:
    """The request's row this iteration is a plain decode."""
    return r.slot >= 0 and r.phase is Phase.INCREMENT


def decodes(batch: Sequence[Request]) -> bool:
    """Every row of the batch decodes in columns this iteration."""
    return all(map(decoding, batch))


@dataclass(slots=True)
class DecodeRows:
    """An iteration's plain decode rows in plan order, as columns: what Scheduler.schedule's rows give for
    them (a row planned ahead of its last token feeds the placeholder -1 at its prev_row)."""

    store: DecodeColumns
    iteration: int                  # the plan's
    rows: list[int]                 # their plan rows
    ids: list[str]
    slots: np.ndarray               # their requests' slots in the store
    starts: np.ndarray              # each row's first position
    toks: np.ndarray                # the token each feeds (-1: the one its previous iteration samples)
    prevs: np.ndarray               # that iteration's sampling row (NO_ROW: its token is given)
    follows: int                    # the iteration it follows (0: none)
    short: list[tuple[int, int, int]]   # rows whose position reached a block their copy lacks: (index, slot, tokens)
    fixed: dict[str, bytes] = field(default_factory=dict)   # columns kept from its batch's last plan (Steady.fixed)

    def grow(self, bm: BlockManager, short: tuple[int, int, int]) -> None:
        """A short row's table grown to its position (the caller keeps the general path's order: blocks are
        taken in plan order) and copied on."""
        i, slot, n_tokens = short
        self.store.copy_table(slot, bm.ensure(self.ids[i], n_tokens))

    def packed(self) -> PackedPlan:
        """These rows' columns, as a plan of them alone."""
        n, at, store, f = len(self.rows), self.slots, self.store, self.fixed
        if not f:
            f.update(q_lens=np.ones(n, I32).tobytes(), sample=np.ones(n, U8).tobytes(), temperature=store.temperature[at].tobytes(),
                     top_k=store.top_k[at].tobytes(), top_p=store.top_p[at].tobytes(), seeds=store.seed[at].tobytes())
        lens = store.tab_len[at].astype(I32)
        return PackedPlan(
            self.iteration, self.ids, f["q_lens"], self.starts.astype(I32).tobytes(), self.toks.astype(I32).tobytes(),
            self.prevs.tobytes(), lens.tobytes(), store.tables(at, lens).tobytes(), f["sample"], f["temperature"],
            f["top_k"], f["top_p"], f["seeds"], b"", [], follows=self.follows)


def decode_rows(store: DecodeColumns, block_size: int, iteration: int, rows: list[int], reqs: list[Request],
                whole: bool, steady: Steady | None = None) -> DecodeRows:
    """The requests' rows at plan rows `rows` of iteration `iteration` + 1, their planning state set as
    Scheduler.schedule sets it; `whole`: they are the whole plan, each samples at its row (its sample_row set
    here too, else by the caller). One pass over the rows in Python for the Request's own state; the rest in
    the store's columns: a row's position and token from its counts, its table from its copy, which the
    caller grows (`grow`) only where the position has reached a new block. `steady`: the requests are its
    batch (their ids, slots and fixed columns are its)."""
    planned, prevs = iteration + 1, []
    for row, r in zip(rows, reqs):
        prevs.append(r.sample_row if r.in_flight else NO_ROW)   # planned before its last token came back
        r.in_flight += 1
        r.chunk = 0
        if whole:
            r.planned, r.sample_row = planned, row
    if steady is None:
        ids, at = [r.request_id for r in reqs], np.array([r.slot for r in reqs], np.intp)
    else:
        ids, at = steady.ids, steady.slots
    prev = np.array(prevs, I32)
    ahead = prev != NO_ROW
    starts = store.n_tok[at] - 1 + ahead
    toks = np.where(ahead, -1, store.last[at])
    rows_short = np.flatnonzero(starts >= store.tab_len[at] * block_size)
    short = list(zip(rows_short.tolist(), at[rows_short].tolist(), (starts[rows_short] + 1).tolist()))
    return DecodeRows(store, planned, rows, ids, at, starts, toks, prev, iteration if ahead.any() else 0, short,
                      {} if steady is None else steady.fixed)


def plan_decode(store: DecodeColumns, bm: BlockManager, batch: list[Request], iteration: int, steady: Steady | None,
                ended: int) -> tuple[IterationPlan, DecodeRows]:
    """The iteration `iteration` + 1 of an all-decode batch, in columns, and its rows (kept for its result);
    `steady`: the batch is the store's kept one (DecodeColumns.kept), else it is kept from now, with `ended`."""
    d = decode_rows(store, bm.block_size, iteration, list(range(len(batch))), batch, whole=True, steady=steady)
    if steady is None:
        store.steady = Steady(list(batch), ended, d.ids, d.slots, d.fixed)
    for short in d.short:
        d.grow(bm, short)
    return IterationPlan(iteration + 1, None, follows=d.follows, packed=d.packed()), d


def merge(sub: PackedPlan, d: DecodeRows, n: int) -> PackedPlan:
    """The plan of n rows from the general path's plan of its other rows (`sub`) and its decode rows `d`: each
    column in plan order, a row-indexed column's rows renumbered, what pack gives for all n rows."""
    dec, keep = np.array(d.rows, np.intp), np.ones(n, bool)
    keep[dec] = False
    other = np.flatnonzero(keep)
    a, b = sub.arrays(), d.packed().arrays()

    def rows(col_o: np.ndarray, col_d: np.ndarray | None, fill: int = 0) -> bytes:
        out = np.empty(n, col_o.dtype)
        out[other] = col_o
        out[dec] = fill if col_d is None else col_d
        return out.tobytes()

    def flat(vals_o: np.ndarray, lens_o: np.ndarray, vals_d: np.ndarray, lens_d: np.ndarray) -> bytes:
        lens = np.empty(n, np.int64)
        lens[other], lens[dec] = lens_o, lens_d
        first = np.cumsum(lens) - lens   # each row's place in the flat column
        out = np.empty(int(lens.sum()), vals_o.dtype)
        for at, ln, vals in ((other, lens_o, vals_o), (dec, lens_d, vals_d)):
            ln = ln.astype(np.int64)
            out[np.repeat(first[at] - (np.cumsum(ln) - ln), ln) + np.arange(len(vals))] = vals
        return out.tobytes()

    def renumber(col: bytes) -> bytes:
        return other[np.frombuffer(col, I32)].astype(I32).tobytes() if col else b""

    lp = {name: rows(getattr(a, name), None, -1) for name in ("logprobs", "prompt_logprobs", "next_tokens")} if sub.logprobs else {}
    return PackedPlan(
        sub.iteration, _ids(sub, d, n, other),
        rows(a.q_lens, b.q_lens), rows(a.start_pos, b.start_pos), flat(a.token_ids, a.q_lens, b.token_ids, b.q_lens),
        rows(a.prev_rows, b.prev_rows), rows(a.table_lens, b.table_lens), flat(a.tables, a.table_lens, b.tables, b.table_lens),
        rows(a.sample, b.sample), rows(a.temperature, b.temperature), rows(a.top_k, b.top_k), rows(a.top_p, b.top_p),
        rows(a.seeds, b.seeds), renumber(sub.mask_rows), sub.masks, follows=max(sub.follows, d.follows), **lp,
        x_rows=renumber(sub.x_rows), x_params=sub.x_params, x_history=sub.x_history, x_bias_lens=sub.x_bias_lens,
        bias_ids=sub.bias_ids, bias_vals=sub.bias_vals, x_seen_lens=sub.x_seen_lens, seen_ids=sub.seen_ids,
        drafts=rows(a.drafts, None) if a.drafts is not None else b"",
        pool_rows=renumber(sub.pool_rows), pool_counts=sub.pool_counts)


def _ids(sub: PackedPlan, d: DecodeRows, n: int, other: np.ndarray) -> list[str]:
    ids: list[str] = [""] * n
    for i, rid in zip(other.tolist(), sub.request_ids):
        ids[i] = rid
    for i, rid in zip(d.rows, d.ids):
        ids[i] = rid
    return ids


def apply_decode(sched: "Scheduler", batch: list[Request], ids: list[str], tokens: list[int], slots: np.ndarray,
                 ended: int, now: float) -> TokenColumns | None:
    """Decode rows' tokens (`batch`, request `ids` and `tokens` in row order: a whole columnar plan's, or the
    decode rows of one merged with the general path's) applied as Scheduler.apply applies them, given their
    `slots` and the scheduler's count of ended requests when they were planned; None (nothing applied) when
    a row needs the general path: it was aborted or finished meanwhile (looked for only when some request
    ended since)."""
    if ended != sched.ended and not all(decoding(r) and not r.aborted for r in batch):
        return None
    store, bm = sched.columns, sched.block_manager
    assert store is not None
    for r, t in zip(batch, tokens):
        r.in_flight -= 1
        r.n_iterations += 1
        r.output_token_ids.append(t)
    n_kv, t = store.n_tok[slots], np.array(tokens, np.int64)   # the K/V now written: every token but the new one
    store.n_tok[slots], store.last[slots] = n_kv + 1, t
    if bm.seed is not None:   # a block it filled joins the prefix cache (no window: computed only publishes)
        published = np.fromiter([r.kv_published for r in batch], np.int64, len(batch))
        if len(full := np.flatnonzero(n_kv // bm.block_size > published)):
            bm.decoded([batch[row] for row in full.tolist()], n_kv[full].tolist())
    out = TokenColumns(ids, tokens)
    eos = (t[:, None] == store.eos).any(axis=1)   # a model has a few EOS ids: cheaper than np.isin
    maybe = (n_kv + 1 - store.n_prompt[slots] >= store.max_tokens[slots]) | store.own_stops[slots] | (store.eos_stops[slots] & eos)
    for row in np.flatnonzero(maybe).tolist():   # the rows whose token may end them: decided by the general rule
        req, token = batch[row], tokens[row]
        if reason := sched._stop_reason(req, token):
            sched._finish(req, reason, now)
            out.finals[row] = TokenEvent(req.request_id, token, reason)
    return out
