"""The logits processors beyond temperature / top-k / top-p, on the last stage, batched on the device.

Per sampling row, in vLLM's order: `logit_bias` and min_tokens' bans (one sparse add; a ban is -inf,
and a row the bans would leave with no token keeps its logits before them: a grammar that only
allows EOS wins over min_tokens), then repetition_penalty (transformers': a logit of a token in the
prompt or the output so far / p if positive, * p if not), then OpenAI's penalties (logit -= presence
x [generated] + frequency x times generated); min_p is the sampler's, on the probabilities after the
temperature. The scheduler computes min_tokens' bans (it knows how many tokens a row's request has
generated, also when planning ahead) and sends them as biases, so this stage needs no EOS or count.

The penalties' token history is kept here, on the device (`TokenHistory`), so a plan never resends
a request's tokens: a penalized request holds one row of two tables (how often each token was
generated, int32 [vocab]; whether it was seen in the prompt or the output, bool [vocab]). The
scheduler marks the row where it starts (HISTORY_START) and lists the requests that ended
(`PackedPlan.released`); the sampled tokens are counted on the device right after sampling, so a
decode row planned ahead (async scheduling) sees the token the iteration before sampled. The prompt
tokens come from the plan's own token ids, plus, once, those a prefix-cache hit skipped
(`RowExtras.seen`). Nothing of this runs for an iteration whose rows ask for none of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from orca_mq.protocol.iteration import HISTORY_KEEP, HISTORY_NONE, HISTORY_START, PlanArrays
from orca_mq.protocol.sampling_fields import is_greedy

Tensor = torch.Tensor


class TokenHistory:
    """Each penalized request's token counts and seen set on the device, one row of two tables per
    request, from its first row to its release; the tables double when full (a copy on the device)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.slots: dict[str, int] = {}
        self.free: list[int] = []
        self.counts = torch.zeros((0, vocab), dtype=torch.int32, device=device)
        self.seen = torch.zeros((0, vocab), dtype=torch.bool, device=device)

    def __len__(self) -> int:
        return len(self.slots)

    def begin(self, a: PlanArrays) -> list[int]:
        """Before the plan samples: drop the released requests' rows, start the rows that start here,
        and mark what its penalized rows feed (and their `seen`) as seen. Returns the plan rows whose
        history is lost (HISTORY_KEEP for a request this stage holds none of: a restarted worker):
        they fail, as their penalties would be wrong."""
        for rid in a.plan.released:
            slot = self.slots.pop(rid, None)
            if slot is not None:
                self.free.append(slot)
        x = a.extras
        if x is None or not (live := np.flatnonzero(x.history != HISTORY_NONE)).size:
            return []
        if (x.seen_ids >= self.vocab).any():
            raise ValueError(f"plan history token ids outside the vocabulary [0, {self.vocab})")
        ends = np.cumsum(a.q_lens)
        seen_ends = np.cumsum(x.seen_lens)
        lost: list[int] = []
        fresh: list[int] = []
        slots: list[np.ndarray] = []
        tokens: list[np.ndarray] = []
        for e in live.tolist():
            row, state = int(x.rows[e]), int(x.history[e])
            rid = a.plan.request_ids[row]
            slot = self.slots.get(rid)
            if slot is None or state == HISTORY_START:
                if slot is None:
                    if state == HISTORY_KEEP:
                        lost.append(row)
                    slot = self._alloc(rid)
                fresh.append(slot)
            if x.params[e, 2] != 1:   # only repetition_penalty reads the seen set
                fed = a.token_ids[ends[row] - a.q_lens[row]: ends[row]]
                ids = np.concatenate((x.seen_ids[seen_ends[e] - x.seen_lens[e]: seen_ends[e]], fed[fed >= 0]))
                slots.append(np.full(len(ids), slot, np.int64))
                tokens.append(ids.astype(np.int64))
        if fresh:
            index = self._tensor(np.array(fresh, np.int64))
            self.counts.index_fill_(0, index, 0)
            self.seen.index_fill_(0, index, False)
        if tokens and sum(map(len, tokens)):
            self.seen[self._tensor(np.concatenate(slots)), self._tensor(np.concatenate(tokens))] = True
        return lost

    def rows(self, request_ids: list[str]) -> Tensor:
        """The table rows of these requests (each has one: `begin` made it)."""
        return self._tensor(np.array([self.slots[r] for r in request_ids], np.int64))

    def record(self, slots: Tensor, tokens: Tensor) -> None:
        """The tokens just sampled for these rows, counted and seen (on the device, no wait)."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        self.seen[slots, tokens] = True

    def _alloc(self, rid: str) -> int:
        if not self.free:
            n = len(self.counts)
            grow = max(8, n)
            self.counts = torch.cat((self.counts, self.counts.new_zeros((grow, self.vocab))))
            self.seen = torch.cat((self.seen, self.seen.new_zeros((grow, self.vocab))))
            self.free = list(range(n + grow - 1, n - 1, -1))
        self.slots[rid] = slot = self.free.pop()
        return slot

    def _tensor(self, values: np.ndarray) -> Tensor:
        return torch.from_numpy(values).to(self.device, non_blocking=True)


@dataclass(slots=True)
class Processors:
    """An iteration's logits processors for its sampling rows (rows of the logits)."""

    bias_rows: np.ndarray      # int64 [B] logit rows...
    bias_ids: np.ndarray       # int64 [B] ...token ids...
    bias_vals: np.ndarray      # float32 [B] ...and what is added (-inf: a ban)
    pen_rows: np.ndarray       # int64 [P] logit rows with a token history
    pen_requests: list[str]    # their requests
    penalties: np.ndarray      # float32 [P, 3] presence, frequency, repetition
    min_p: np.ndarray          # float32 [S] every sampling row's (0: off)

    @classmethod
    def of(cls, a: PlanArrays, sampling: np.ndarray) -> "Processors | None":
        """The plan's processors for its sampling rows `sampling` (plan rows, ascending); None when none has any."""
        x = a.extras
        if x is None:
            return None
        logit_row = np.full(a.num_rows, -1, np.int64)
        logit_row[sampling] = np.arange(len(sampling))
        rows = logit_row[x.rows]                           # -1: a row that does not sample
        bias_rows = np.repeat(rows, x.bias_lens)
        keep = bias_rows >= 0
        pen = (rows >= 0) & (x.history != HISTORY_NONE)
        min_p = np.zeros(len(sampling), np.float32)
        min_p[rows[rows >= 0]] = x.params[rows >= 0, 3]
        min_p[is_greedy(a.temperature[sampling], a.top_k[sampling])] = 0   # greedy keeps its argmax anyway
        if not keep.any() and not pen.any() and not min_p.any():
            return None
        return cls(bias_rows[keep], x.bias_ids[keep].astype(np.int64), x.bias_vals[keep], rows[pen],
                   [a.plan.request_ids[r] for r in x.rows[pen].tolist()], x.params[pen, :3], min_p)

    def bans(self) -> bool:
        return bool(np.isneginf(self.bias_vals).any())

    def apply(self, logits: Tensor, history: TokenHistory | None, kernel: ModuleType | None = None) -> Tensor:
        """The biases, bans and penalties applied (a new tensor; `logits` is left as it is). `kernel`: the CPU
        extension, which does it all in one call (kernels/csrc/processors_cpu.cpp) on float32 logits."""
        penalized = len(self.pen_rows) > 0 and history is not None
        if not len(self.bias_rows) and not penalized:
            return logits
        if len(self.bias_ids) and int(self.bias_ids.max()) >= logits.shape[-1]:   # a malformed plan: on a device
            raise ValueError(f"plan logit-bias token ids outside the vocabulary [0, {logits.shape[-1]})")   # an assert
        logits = logits.clone()
        dev = logits.device

        def t(v: np.ndarray) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(v)).to(dev, non_blocking=True)

        if kernel is not None:
            if penalized:
                assert history is not None
                pen = (t(self.pen_rows), history.rows(self.pen_requests), history.counts, history.seen, t(self.penalties))
            else:
                pen = (t(np.zeros(0, np.int64)), t(np.zeros(0, np.int64)), torch.zeros(0, 0, dtype=torch.int32),
                       torch.zeros(0, 0, dtype=torch.bool), t(np.zeros((0, 3), np.float32)))
            kernel.process_rows(logits, t(self.bias_rows), t(self.bias_ids), t(self.bias_vals), *pen)
            return logits

        ban = np.isneginf(self.bias_vals)
        if (~ban).any():
            logits.index_put_((t(self.bias_rows[~ban]), t(self.bias_ids[~ban])), t(self.bias_vals[~ban]), accumulate=True)
        if ban.any():   # min_tokens: unless that leaves the row nothing (its grammar allows only what is banned)
            banned = np.unique(self.bias_rows[ban])
            index = t(banned)
            before = logits.index_select(0, index)
            logits.index_put_((t(self.bias_rows[ban]), t(self.bias_ids[ban])), torch.tensor(float("-inf"), device=dev))
            after = logits.index_select(0, index)
            logits.index_copy_(0, index, torch.where(torch.isneginf(after).all(dim=-1, keepdim=True), before, after))
        if len(self.pen_rows) and history is not None:
            index, slots = t(self.pen_rows), history.rows(self.pen_requests)
            pen = t(self.penalties)
            rows = logits.index_select(0, index)
            rep = pen[:, 2:3]
            rows = torch.where(history.seen.index_select(0, slots), torch.where(rows > 0, rows / rep, rows * rep), rows)
            counts = history.counts.index_select(0, slots).float()
            rows = rows - pen[:, 1:2] * counts - pen[:, 0:1] * (counts > 0).float()
            logits.index_copy_(0, index, rows)
        return logits

    def record(self, history: TokenHistory | None, tokens: Tensor) -> None:
        """The sampled tokens into the penalized rows' histories."""
        if history is not None and len(self.pen_rows):
            index = torch.from_numpy(self.pen_rows).to(tokens.device, non_blocking=True)
            history.record(history.rows(self.pen_requests), tokens.index_select(0, index))
