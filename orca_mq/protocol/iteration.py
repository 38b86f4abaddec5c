"""What one engine iteration is: the control frame's payload and the tokens it returns.

The scheduler decides everything (which requests, which KV blocks, which swaps); every
pipeline stage applies the same plan to its own layers, so stages never disagree.

The scheduler builds an `IterationPlan` of `SeqWork` rows; on the wire, and inside the engine, it
travels as a `PackedPlan`: the same rows in columns (little-endian arrays as bytes), so a worker
reads an iteration of 512 requests with a few `frombuffer` calls instead of building 512 objects,
and derives every per-token input with array arithmetic (orca_mq/engine/step_inputs.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from orca_mq.protocol.logprobs import TokenLogprobs

MASK_WORD_BITS = 32   # an allowed-token bitmask is little-endian 32-bit words: bit i of word j allows token 32 j + i
NO_ROW = -1           # SeqWork.prev_row: its first token is given, not taken from the previous iteration
# RowExtras.history: the last stage's token history of a penalized request (orca_mq/engine/history.py)
HISTORY_NONE, HISTORY_START, HISTORY_KEEP = 0, 1, 2   # none (no penalty) | it starts at this row | it goes on


def mask_bytes(vocab_size: int) -> int:
    """Size of one row's allowed-token bitmask (here, not in the sampler: the scheduler fills masks without torch)."""
    return -(-vocab_size // MASK_WORD_BITS) * MASK_WORD_BITS // 8


I32, I64, F32, U8 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4"), np.dtype("u1")


@dataclass(frozen=True, slots=True, eq=False)
class Biases:
    """A row's logit biases as columns: token ids (int32) and what is added (float32; -inf: a ban), read-only.
    A request's logit_bias is made once and shared by its rows, and a plan's are concatenated: not rebuilt
    from 1,024 pairs a row each iteration (16 such rows: 1.3 ms of the scheduler's loop). min_tokens' bans,
    while they last, are a few more appended."""

    ids: np.ndarray
    vals: np.ndarray

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, float]]) -> "Biases":
        pairs = list(pairs)
        return cls.columns(np.array([t for t, _ in pairs], I32), np.array([b for _, b in pairs], F32))

    @classmethod
    def columns(cls, ids: np.ndarray, vals: np.ndarray) -> "Biases":
        ids, vals = ids.astype(I32), vals.astype(F32)   # copies, then frozen: rows and requests share them
        ids.setflags(write=False)
        vals.setflags(write=False)
        return cls(ids, vals)

    def __add__(self, other: "Biases") -> "Biases":
        return Biases.columns(np.concatenate((self.ids, other.ids)), np.concatenate((self.vals, other.vals)))

    def __len__(self) -> int:
        return len(self.ids)


NO_BIASES = Biases.of([])


@dataclass(slots=True)
class RowExtras:
    """A row's logits processors beyond temperature / top-k / top-p (SamplingParams' penalties, min_p,
    logit_bias, min_tokens), for a request that asks for any; the last stage applies them in
    orca_mq/engine/history.py. What a penalty needs of the request's past tokens stays there."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_p: float = 0.0
    bias: Biases = NO_BIASES  # added to the logits: logit_bias, -inf for min_tokens' bans
    history: int = HISTORY_NONE
    seen: list[int] = field(default_factory=list)  # repetition_penalty: prompt tokens the history has not seen and token_ids does not carry (prefix cache hits)


@dataclass(slots=True)
class SeqWork:
    """One request's share of an iteration (ORCA: INITIATION = whole prompt, INCREMENT = one token)."""

    request_id: str
    token_ids: list[int]          # new tokens this iteration
    start_pos: int                # tokens already in the KV cache = position of token_ids[0]
    block_table: list[int]        # device KV blocks covering start_pos + len(token_ids) tokens
    temperature: float = 0.0      # sampling, used by the last stage only
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    allowed_token_bitmask: bytes | None = None  # structured outputs: the grammar's allowed tokens, mask_bytes(vocab) long (engine/sampler.py)
    sample: bool = True           # False: a prompt chunk with more of the prompt to come: no logits, no token
    # async scheduling: token_ids[0] is the token the previous iteration (IterationPlan.follows) samples
    # for its sampling row `prev_row` (planned before that token came back); token_ids[0] is -1 then
    prev_row: int = NO_ROW
    # log probabilities (orca_mq/protocol/logprobs.py), -1: not asked. `logprobs`: of the sampled token
    # and its k most likely; `prompt_logprobs`: of each prompt token after this row's first, whose
    # targets are token_ids[1:] then `next_token` (the prompt's token after this chunk; -1 on its last)
    logprobs: int = -1
    prompt_logprobs: int = -1
    next_token: int = -1
    extra: RowExtras | None = None   # its logits processors; None: none (what every other row costs)
    # speculative decoding: the last `draft` of token_ids are proposed tokens, not yet the request's: a
    # verify row samples after each of its last draft + 1 tokens and keeps the longest agreeing prefix;
    # a constrained one has a bitmask for the positions after its draft tokens too (its grammar advanced by them)
    draft: int = 0
    draft_bitmasks: list[bytes] = field(default_factory=list)
    # embeddings (orca_mq/protocol/pooling.py): the last stage returns the sum of the final norm's output
    # over this row's last `pool` tokens (0: none); such a row samples nothing
    pool: int = 0

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class IterationPlan:
    iteration: int
    rows: list[SeqWork] | None    # None: planned in columns (`packed`, orca_mq/sched/columns.py); `seqs` unpacks them
    # KV block copies every stage applies before computing this iteration (FastServe):
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device_block, host_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host_block, device_block)
    follows: int = 0              # the iteration whose sampled tokens fill rows with a prev_row (0: none)
    released: list[str] = field(default_factory=list)   # requests that ended with a token history on the last stage
    packed: "PackedPlan | None" = None   # its columns, when the scheduler planned it in columns (what pack returns)
    kept: list[tuple[int, SeqWork]] = field(default_factory=list)   # ...and its rows planned as objects, by plan row

    @property
    def seqs(self) -> list[SeqWork]:
        """Its rows as objects (a plan made in columns makes them when first asked: tests and tools ask, serving does not)."""
        if self.rows is None:
            assert self.packed is not None
            self.rows = unpack_rows(self.packed.arrays())
            for row, seq in self.kept:
                self.rows[row] = seq
        return self.rows

    @property
    def num_rows(self) -> int:
        return len(self.packed.request_ids) if self.rows is None else len(self.rows)   # type: ignore[union-attr]

    @property
    def num_tokens(self) -> int:
        if self.rows is None:
            return self.packed.num_tokens   # type: ignore[union-attr]
        return sum(len(s.token_ids) for s in self.rows)


@dataclass(slots=True)
class PackedPlan:
    """An IterationPlan in columns (S rows, T new tokens): the control frame's payload."""

    iteration: int
    request_ids: list[str]
    q_lens: bytes          # int32 [S] new tokens of each row
    start_pos: bytes       # int32 [S]
    token_ids: bytes       # int32 [T]
    prev_rows: bytes       # int32 [S] SeqWork.prev_row
    table_lens: bytes      # int32 [S]
    tables: bytes          # int32 [sum table_lens] the rows' block tables, concatenated
    sample: bytes          # uint8 [S]
    temperature: bytes     # float32 [S]
    top_k: bytes           # int32 [S]
    top_p: bytes           # float32 [S]
    seeds: bytes           # int64 [S] (-1: unseeded)
    mask_rows: bytes       # int32 [M] rows with an allowed-token bitmask (a verify row: one per sampled position, in order)
    masks: list[bytes]     # their bitmasks
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    follows: int = 0
    # log probabilities: int32 [S] each (SeqWork's), all three empty when no row asks for any
    logprobs: bytes = b""
    prompt_logprobs: bytes = b""
    next_tokens: bytes = b""
    # logits processors (RowExtras) of the rows that carry any, all empty when none does
    x_rows: bytes = b""        # int32 [E] their plan rows, ascending
    x_params: bytes = b""      # float32 [E, 4] presence, frequency and repetition penalties, min_p
    x_history: bytes = b""     # uint8 [E] HISTORY_*
    x_bias_lens: bytes = b""   # int32 [E]
    bias_ids: bytes = b""      # int32 [sum x_bias_lens] token ids...
    bias_vals: bytes = b""     # float32 [...] ...and what is added to their logits (-inf: min_tokens' bans)
    x_seen_lens: bytes = b""   # int32 [E]
    seen_ids: bytes = b""      # int32 [sum x_seen_lens] RowExtras.seen, concatenated
    released: list[str] = field(default_factory=list)   # IterationPlan.released
    drafts: bytes = b""        # int32 [S] SeqWork.draft, empty when no row verifies a draft
    # embeddings: the rows that pool (ascending) and each one's SeqWork.pool, both empty when none does
    pool_rows: bytes = b""     # int32 [P]
    pool_counts: bytes = b""   # int32 [P]

    def arrays(self) -> "PlanArrays":
        """The columns as arrays, checked for consistent sizes (ValueError otherwise); the engine checks
        their values against the model and the pool."""
        def col(data: bytes, dtype: np.dtype, name: str) -> np.ndarray:
            if len(data) % dtype.itemsize:
                raise ValueError(f"plan column {name}: {len(data)} bytes is not a whole number of {dtype}")
            return np.frombuffer(data, dtype)

        s = len(self.request_ids)
        a = PlanArrays(self, *(col(getattr(self, n), d, n) for n, d in _COLUMNS))
        for name, dtype in _COLUMNS:
            if name not in ("token_ids", "tables", "mask_rows") and len(getattr(a, name)) != s:
                raise ValueError(f"plan column {name} has {len(getattr(a, name))} rows, the plan {s}")
        if (a.q_lens < 1).any() or (a.start_pos < 0).any() or (a.table_lens < 0).any():
            raise ValueError("plan rows need q_len >= 1, start_pos >= 0 and table_lens >= 0")
        if int(a.q_lens.sum()) != len(a.token_ids) or int(a.table_lens.sum()) != len(a.tables):
            raise ValueError("plan token or block-table columns do not add up to the rows' lengths")
        if len(a.mask_rows) != len(self.masks) or ((a.mask_rows < 0) | (a.mask_rows >= s)).any():
            raise ValueError("plan masks do not match their rows")
        if ((a.prev_rows < NO_ROW) | ((a.prev_rows >= 0) & (self.follows <= 0))).any():
            raise ValueError("plan rows follow no earlier iteration")
        _logprob_columns(self, a, col)
        a.extras = _extra_columns(self, col)
        if self.drafts:
            a.drafts = col(self.drafts, I32, "drafts")
            if len(a.drafts) != s or (a.drafts < 0).any() or (a.drafts >= a.q_lens).any() or (a.drafts[a.sample == 0] > 0).any():
                raise ValueError("plan draft column: a row each, fewer drafts than the row's tokens, on sampling rows only")
        _pool_columns(self, a, col)
        if len(a.mask_rows) and (np.bincount(a.mask_rows, minlength=s) > 1 + (0 if a.drafts is None else a.drafts)).any():
            raise ValueError("plan masks: more for a row than it samples positions")
        return a

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // I32.itemsize

    def block_ids(self) -> set[int]:
        """The device blocks the iteration's rows read or write."""
        return set(np.frombuffer(self.tables[: len(self.tables) // 4 * 4], I32).tolist())


_COLUMNS = (("q_lens", I32), ("start_pos", I32), ("token_ids", I32), ("prev_rows", I32), ("table_lens", I32),
            ("tables", I32), ("sample", U8), ("temperature", F32), ("top_k", I32), ("top_p", F32), ("seeds", I64),
            ("mask_rows", I32))


@dataclass(slots=True)
class PlanArrays:
    """A PackedPlan's columns as read-only arrays (views of its bytes)."""

    plan: PackedPlan
    q_lens: np.ndarray
    start_pos: np.ndarray
    token_ids: np.ndarray
    prev_rows: np.ndarray
    table_lens: np.ndarray
    tables: np.ndarray
    sample: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    mask_rows: np.ndarray
    logprobs: np.ndarray | None = None          # int32 [S] when a row asks (PackedPlan's), else None
    prompt_logprobs: np.ndarray | None = None
    next_tokens: np.ndarray | None = None
    extras: "ExtraArrays | None" = None          # the rows' logits processors, when any row has them
    drafts: np.ndarray | None = None             # int32 [S] when a row verifies a draft (PackedPlan's), else None
    pool_rows: np.ndarray | None = None          # int32 [P] when a row pools (PackedPlan's), else None
    pool_counts: np.ndarray | None = None        # int32 [P]

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    def sampled_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """Each sampled position, in the LM head's row order (a sampling row's last token, a verify row's
        last draft + 1 tokens): its plan row, and its place among its row's (0 .. draft), int64."""
        rows = np.flatnonzero(self.sample)
        if self.drafts is None:
            return rows, np.zeros(len(rows), np.int64)
        rows = np.repeat(rows, 1 + self.drafts[rows].astype(np.int64))
        return rows, np.arange(len(rows)) - np.searchsorted(rows, rows)


def _logprob_columns(plan: PackedPlan, a: PlanArrays, col: "Callable[[bytes, np.dtype, str], np.ndarray]") -> None:
    """The log-probability columns, when the plan has them: all three or none, a row each."""
    given = [bool(plan.logprobs), bool(plan.prompt_logprobs), bool(plan.next_tokens)]
    if not any(given):
        return
    s = len(plan.request_ids)
    cols = [col(getattr(plan, n), I32, n) for n in ("logprobs", "prompt_logprobs", "next_tokens")]
    if not all(given) or any(len(c) != s for c in cols):
        raise ValueError(f"plan log-probability columns do not have the plan's {s} rows")
    if any(bool((c < -1).any()) for c in cols):
        raise ValueError("plan log-probability columns hold a value below -1")
    a.logprobs, a.prompt_logprobs, a.next_tokens = cols


def _pool_columns(plan: PackedPlan, a: PlanArrays, col: "Callable[[bytes, np.dtype, str], np.ndarray]") -> None:
    """The pooling columns, when the plan has them: ascending plan rows, each pooling 1 .. q_len of its last tokens."""
    if not plan.pool_rows and not plan.pool_counts:
        return
    rows, counts = col(plan.pool_rows, I32, "pool_rows"), col(plan.pool_counts, I32, "pool_counts")
    s = len(plan.request_ids)
    if len(rows) != len(counts) or not len(rows) or rows[0] < 0 or rows[-1] >= s or (np.diff(rows) <= 0).any():
        raise ValueError("plan pooling columns: as many counts as rows, the rows ascending plan rows")
    if (counts < 1).any() or (counts > a.q_lens[rows]).any():
        raise ValueError("plan pooling columns: a row pools 1 .. its q_len tokens")
    a.pool_rows, a.pool_counts = rows, counts


def _pack_logprobs(seqs: list[SeqWork]) -> tuple[bytes, bytes, bytes]:
    """The log-probability columns, or nothing when no row asks (what every other plan costs)."""
    if all(s.logprobs < 0 and s.prompt_logprobs < 0 for s in seqs):
        return b"", b"", b""
    return (np.array([s.logprobs for s in seqs], I32).tobytes(), np.array([s.prompt_logprobs for s in seqs], I32).tobytes(),
            np.array([s.next_token for s in seqs], I32).tobytes())


@dataclass(slots=True)
class ExtraArrays:
    """A plan's RowExtras columns as arrays (PackedPlan's x_*, bias_*, seen_ids)."""

    rows: np.ndarray          # int32 [E]
    params: np.ndarray        # float32 [E, 4]
    history: np.ndarray       # uint8 [E]
    bias_lens: np.ndarray     # int32 [E]
    bias_ids: np.ndarray
    bias_vals: np.ndarray
    seen_lens: np.ndarray     # int32 [E]
    seen_ids: np.ndarray


def _extra_columns(plan: PackedPlan, col: "Callable[[bytes, np.dtype, str], np.ndarray]") -> ExtraArrays | None:
    """The logits processors' columns, checked for consistent sizes and values; None when no row has any."""
    names = ("x_rows", "x_params", "x_history", "x_bias_lens", "bias_ids", "bias_vals", "x_seen_lens", "seen_ids")
    if not any(getattr(plan, n) for n in names):
        return None
    x = ExtraArrays(*(col(getattr(plan, n), d, n) for n, d in zip(names, (I32, F32, U8, I32, I32, F32, I32, I32))))
    e, s = len(x.rows), len(plan.request_ids)
    if len(x.params) != 4 * e or len(x.history) != e or len(x.bias_lens) != e or len(x.seen_lens) != e:
        raise ValueError(f"plan logits-processor columns do not have their {e} rows")
    x.params = x.params.reshape(e, 4)
    if e and (x.rows[0] < 0 or x.rows[-1] >= s or (np.diff(x.rows) <= 0).any()):
        raise ValueError("plan logits-processor rows are not ascending plan rows")
    if (x.bias_lens < 0).any() or (x.seen_lens < 0).any() or int(x.bias_lens.sum()) != len(x.bias_ids) \
            or len(x.bias_vals) != len(x.bias_ids) or int(x.seen_lens.sum()) != len(x.seen_ids):
        raise ValueError("plan logit-bias or history columns do not add up to their rows' lengths")
    if (x.history > HISTORY_KEEP).any() or (x.bias_ids < 0).any() or (x.seen_ids < 0).any():
        raise ValueError("plan logits-processor columns hold a negative token id or an unknown history state")
    if not np.isfinite(x.params).all() or np.isnan(x.bias_vals).any() or (x.bias_vals == np.inf).any():
        raise ValueError("plan logits-processor values are not finite (a bias may be -inf only)")
    return x


def _pack_extras(plan: IterationPlan) -> dict[str, bytes | list[str]]:
    """PackedPlan's logits-processor fields: nothing but the released ids when no row has any."""
    rows = [(i, s.extra) for i, s in enumerate(plan.seqs) if s.extra is not None]
    if not rows:
        return {"released": list(plan.released)}
    xs = [x for _, x in rows]
    return {
        "x_rows": np.array([i for i, _ in rows], I32).tobytes(),
        "x_params": np.array([(x.presence, x.frequency, x.repetition, x.min_p) for x in xs], F32).tobytes(),
        "x_history": np.array([x.history for x in xs], U8).tobytes(),
        "x_bias_lens": np.array([len(x.bias) for x in xs], I32).tobytes(),
        "bias_ids": np.concatenate([x.bias.ids for x in xs]).tobytes(),
        "bias_vals": np.concatenate([x.bias.vals for x in xs]).tobytes(),
        "x_seen_lens": np.array([len(x.seen) for x in xs], I32).tobytes(),
        "seen_ids": np.array([t for x in xs for t in x.seen], I32).tobytes(),
        "released": list(plan.released),
    }


def pack(plan: IterationPlan) -> PackedPlan:
    """The plan in columns: one pass per column, no per-row objects on the other side (a plan made in
    columns has them: only what the policy set after planning, its swaps, joins)."""
    if plan.packed is not None:
        p = plan.packed
        p.swap_out, p.swap_in, p.follows, p.released = list(plan.swap_out), list(plan.swap_in), plan.follows, list(plan.released)
        return p
    seqs = plan.seqs

    def col(values: list[int] | list[float] | chain[int], dtype: np.dtype) -> bytes:
        return np.fromiter(values, dtype, -1).tobytes() if isinstance(values, chain) else np.array(values, dtype).tobytes()

    masked = [(i, m) for i, s in enumerate(seqs) if s.allowed_token_bitmask is not None
              for m in (s.allowed_token_bitmask, *s.draft_bitmasks)]
    return PackedPlan(
        plan.iteration, [s.request_id for s in seqs],
        col([len(s.token_ids) for s in seqs], I32), col([s.start_pos for s in seqs], I32),
        col(chain.from_iterable(s.token_ids for s in seqs), I32), col([s.prev_row for s in seqs], I32),
        col([len(s.block_table) for s in seqs], I32), col(chain.from_iterable(s.block_table for s in seqs), I32),
        col([s.sample for s in seqs], U8), col([s.temperature for s in seqs], F32), col([s.top_k for s in seqs], I32),
        col([s.top_p for s in seqs], F32), col([-1 if s.seed is None else s.seed for s in seqs], I64),
        col([i for i, _ in masked], I32), [m for _, m in masked],  # type: ignore[misc]
        list(plan.swap_out), list(plan.swap_in), plan.follows, *_pack_logprobs(seqs), **_pack_extras(plan),
        drafts=col([s.draft for s in seqs], I32) if any(s.draft for s in seqs) else b"",
        **_pack_pool(seqs),
    )


def unpack_rows(a: PlanArrays) -> list[SeqWork]:
    """A plan's plain decode rows as SeqWork, as the scheduler's general path makes them (its other rows, which
    may carry masks, log-probability asks, logits processors or pooling, are IterationPlan.kept)."""
    q, tl = np.cumsum(a.q_lens).tolist(), np.cumsum(a.table_lens).tolist()
    toks, tabs = a.token_ids.tolist(), a.tables.tolist()
    return [SeqWork(rid, toks[q[i] - n:q[i]], start, tabs[tl[i] - m:tl[i]], temp, top_k, top_p, None if seed < 0 else seed,
                    sample=bool(smp), prev_row=prev)
            for i, (rid, n, start, m, temp, top_k, top_p, seed, smp, prev) in enumerate(zip(
                a.plan.request_ids, a.q_lens.tolist(), a.start_pos.tolist(), a.table_lens.tolist(), a.temperature.tolist(),
                a.top_k.tolist(), a.top_p.tolist(), a.seeds.tolist(), a.sample.tolist(), a.prev_rows.tolist()))]


def _pack_pool(seqs: list[SeqWork]) -> dict[str, bytes]:
    """PackedPlan's pooling columns: nothing when no row pools (what every other plan costs)."""
    rows = [i for i, s in enumerate(seqs) if s.pool]
    if not rows:
        return {}
    return {"pool_rows": np.array(rows, I32).tobytes(), "pool_counts": np.array([seqs[i].pool for i in rows], I32).tobytes()}


@dataclass(slots=True)
class IterationResult:
    iteration: int
    # one sampled token per row of the plan, in its order (-1 where it samples nothing): the plan of
    # `iteration` names the rows' requests, so their ids are not sent back (256 strings an iteration)
    token_ids: list[int]
    failed: list[str] = field(default_factory=list)  # requests whose work failed: they end with an error
    # log probabilities where the plan asked: plan rows, and each one's entry (one position: its
    # sampled token) or its prompt positions (prompt_logprobs)
    logprob_rows: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # speculative decoding: each verify row's tokens after token_ids[row] (its accepted drafts' successors:
    # the drafts it accepted are among them, its last the first disagreeing or the bonus token)
    verify_rows: list[int] = field(default_factory=list)
    verified: list[list[int]] = field(default_factory=list)
    # embeddings: the plan rows that pooled, and each one's float32 sum (orca_mq/protocol/pooling.py) of
    # the final norm's output over its pooled tokens: [len(pool_rows), hidden] little-endian, in one buffer
    pool_rows: list[int] = field(default_factory=list)
    pooled: bytes = b""
