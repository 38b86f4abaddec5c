"""Log probabilities on the last stage, only for the rows that ask (orca_mq/protocol/logprobs.py).

Two kinds: a sampling row's `logprobs` (its sampled token's and its k most likely, from the same
logits the sampler reads) and a row's `prompt_logprobs` (each prompt position's next token's, from
extra LM-head rows over the prompt positions: `prompt_positions` names them, the model computes them
in an LM-head call of their own after the sampling rows', so those keep their shape). Values are
log_softmax of the raw logits in float32, before temperature, top-k/top-p and masks (vLLM's default).

Everything here is issued on the device and copied back without waiting: an iteration whose rows
ask for nothing never calls it, and one that asks waits for the device only where it collects.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import cpu_kernels
from orca_mq.protocol.iteration import IterationResult, PlanArrays
from orca_mq.protocol.logprobs import TokenLogprobs

Tensor = torch.Tensor


@dataclass(slots=True)
class PromptPositions:
    """The prompt positions whose next token's log probability an iteration computes."""

    rows: list[int]           # plan rows asking, in order
    counts: list[int]         # positions of each
    ks: list[int]             # alternatives each asks for
    token_rows: np.ndarray    # int64 [P] the positions' token rows in the iteration (the extra LM-head rows)
    targets: np.ndarray       # int64 [P] the token each position predicts


def prompt_positions(a: PlanArrays) -> PromptPositions | None:
    """A chunk at start s of q tokens predicts tokens s+1 .. s+q-1 and, when the prompt goes on past
    it, the next chunk's first (`next_tokens`); a prompt's last position is its sampling row."""
    if a.prompt_logprobs is None or a.next_tokens is None:
        return None
    asking = np.flatnonzero(a.prompt_logprobs >= 0)
    if not len(asking):
        return None
    q = a.q_lens.astype(np.int64)
    row_start = np.cumsum(q) - q
    rows, counts, ks, token_rows, targets = [], [], [], [], []
    for r in asking.tolist():
        start, n, nxt = int(row_start[r]), int(q[r]), int(a.next_tokens[r])
        m = n - 1 + (nxt >= 0)
        if m <= 0:
            continue
        rows.append(r)
        counts.append(m)
        ks.append(int(a.prompt_logprobs[r]))
        token_rows.append(np.arange(start, start + m))
        following = a.token_ids[start + 1:start + n].astype(np.int64)
        targets.append(np.concatenate((following, [nxt])) if nxt >= 0 else following)
    if not rows:
        return None
    return PromptPositions(rows, counts, ks, np.concatenate(token_rows), np.concatenate(targets))


@dataclass(slots=True)
class LogprobsOut:
    """One kind's log probabilities, issued on the device (host copies once `copy` ran)."""

    rows: list[int]                 # plan rows
    counts: list[int]               # positions of each row (sampled: one)
    ks: list[int]
    targets: Tensor | None          # prompt: the tokens predicted (host, int64); sampled: None (the result's tokens)
    chosen: Tensor                  # [P] float32 the target's
    top_v: Tensor                   # [P, kmax] float32
    top_i: Tensor                   # [P, kmax] int64

    def copy(self) -> "LogprobsOut":
        """The same on the host, copied without waiting (pinned memory on CUDA: the caller's event covers it)."""
        if not self.chosen.is_cuda:
            return self

        def host(t: Tensor) -> Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        return LogprobsOut(self.rows, self.counts, self.ks, self.targets, host(self.chosen), host(self.top_v),
                           host(self.top_i))

    def entries(self, tokens: list[int] | None = None) -> list[TokenLogprobs]:
        """Per row, its positions' TokenLogprobs, each cut to its own k (read after the copy landed)."""
        chosen, top_v, top_i = self.chosen.tolist(), self.top_v.tolist(), self.top_i.tolist()
        targets = tokens if tokens is not None else self.targets.tolist()  # type: ignore[union-attr]
        out, at = [], 0
        for n, k in zip(self.counts, self.ks):
            out.append(TokenLogprobs(targets[at:at + n], chosen[at:at + n], [v[:k] for v in top_i[at:at + n]],
                                     [v[:k] for v in top_v[at:at + n]]))
            at += n
        return out


FUSED_K = 64   # the CPU kernel keeps a row's k largest in a sorted array: for at most this many


def _compute(logits: Tensor, rows: Tensor | None, targets: Tensor, kmax: int) -> tuple[Tensor, Tensor, Tensor]:
    """logits' `rows` (None: all) at their targets, and their kmax largest. On the CPU the extension's
    log_probs_rows: one pass per row for the log-sum-exp and one scan for the k largest, where torch's
    log_softmax, gather and topk each pass over a new [rows, vocab] tensor."""
    k = min(kmax, logits.shape[-1])
    ext = cpu_kernels.load() if logits.device.type == "cpu" and k <= FUSED_K else None
    if ext is not None:
        everyone = torch.arange(logits.shape[0]) if rows is None else rows
        chosen, top_v, top_i = ext.log_probs_rows(logits.float(), everyone, targets, k)
        return chosen, top_v, top_i
    if rows is not None:
        logits = logits.index_select(0, rows)
    lp = torch.log_softmax(logits.float(), dim=-1)   # vLLM: log_softmax of the raw logits in float32
    chosen = lp.gather(1, targets[:, None]).squeeze(1)
    top_v, top_i = lp.topk(k, dim=-1)
    return chosen, top_v, top_i


def sampled_logprobs(logits: Tensor, tokens: Tensor, a: PlanArrays, sampling: np.ndarray) -> LogprobsOut | None:
    """The sampling rows that ask: logits [S, vocab] and tokens [S] of the sampling rows, `sampling`
    their plan rows."""
    if a.logprobs is None:
        return None
    ks = a.logprobs[sampling]
    asking = np.flatnonzero(ks >= 0)
    if not len(asking):
        return None
    k = ks[asking].tolist()
    idx = torch.from_numpy(asking.astype(np.int64)).to(logits.device)
    chosen, top_v, top_i = _compute(logits, idx, tokens.index_select(0, idx), max(k))
    return LogprobsOut(sampling[asking].tolist(), [1] * len(k), k, None, chosen, top_v, top_i)


def prompt_logprobs(logits: Tensor, positions: PromptPositions) -> LogprobsOut:
    """logits [P, vocab]: the extra LM-head rows, in `positions`' order."""
    targets = torch.from_numpy(positions.targets)
    chosen, top_v, top_i = _compute(logits, None, targets.to(logits.device), max(positions.ks))
    return LogprobsOut(positions.rows, positions.counts, positions.ks, targets, chosen, top_v, top_i)


def fill_result(result: IterationResult, sampled: LogprobsOut | None, prompt: LogprobsOut | None) -> None:
    """The collected iteration's log probabilities into its result (rows that failed keep theirs: the
    scheduler drops a failed request's events)."""
    if sampled is not None:
        result.logprob_rows = sampled.rows
        result.logprobs = sampled.entries([result.token_ids[r] for r in sampled.rows])
    if prompt is not None:
        result.prompt_rows = prompt.rows
        result.prompt_logprobs = prompt.entries()
