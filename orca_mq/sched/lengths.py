"""What FastServe knows of output lengths: their law, learned from this server's own requests; never a
running request's own length (only the SRPT oracle knows those).

The law is a Kaplan-Meier estimate over the last `window` requests that left (a length that ended
with stop or length; a lower bound for an abort or an error) and the jobs still in the pool (each a
lower bound: its attained tokens and more), plus `prior_jobs` pseudo-requests of a geometric law.
Counting the jobs in the pool keeps the estimate from seeing only the short jobs that finish first
under a growing queue. The prior is memoryless: before anything is known, a job's attained service
says nothing of what it has left.

What FastServe asks of it is a job's expected remaining service, E[D - a | D > a] tokens after `a`
tokens. Whether preempting a started job for a new one pays depends on it (`worth_preempting`): with
a heavy-tailed law (FastServe's Zipf traces) a job that has run long is likely to run much longer,
and a new job is worth its place; with a light-tailed one (ORCA's uniform trace) a started job is
closer to its end than a new one, and preempting it only makes both finish later.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

PRIOR_MEAN = 128.0    # mean of the geometric prior law, in tokens
REFRESH_EVERY = 16    # requests leaving between two estimates, once it has seen 8 x as many


class OutputLengths:
    def __init__(self, max_len: int, window: int, prior_jobs: float) -> None:
        if max_len < 1 or window < 0 or prior_jobs <= 0:
            raise ValueError("output lengths: need max_len >= 1, window >= 0, prior_jobs > 0")
        self.max_len = max_len
        prior = (1.0 - 1.0 / PRIOR_MEAN) ** np.arange(max_len, dtype=np.float64)
        self.prior = prior * (prior_jobs / prior.sum())     # pseudo-deaths at lengths 1 .. max_len
        self.recent: deque[tuple[int, bool]] = deque(maxlen=window)   # (tokens, ended there)
        self.unseen = 0
        self.remaining = self._estimate(())

    def observe(self, n_tokens: int, ended: bool) -> bool:
        """A request left with `n_tokens` output tokens: all it had (`ended`: stop or length) or a lower
        bound (abort, error). True when the law should be estimated again (`refresh`)."""
        if self.recent.maxlen == 0:
            return False
        self.recent.append((min(max(n_tokens, 0), self.max_len), ended))
        self.unseen += 1
        return self.unseen >= min(REFRESH_EVERY, 1 + len(self.recent) // 8)   # often while it knows little

    def refresh(self, in_pool: Iterable[int]) -> None:
        """Estimate the law again, with the attained tokens of the jobs still in the pool as lower bounds."""
        self.unseen = 0
        self.remaining = self._estimate(in_pool)

    def _estimate(self, in_pool: Iterable[int]) -> np.ndarray:
        """Kaplan-Meier; returns E[D - a | D > a] for a = 0 .. max_len."""
        deaths = self.prior.copy()              # deaths[x - 1]: ended with exactly x tokens
        censored = np.zeros(self.max_len + 1)    # censored[x]: known to have more than x tokens
        for n, ended in self.recent:
            if ended and n:
                deaths[n - 1] += 1
            else:
                censored[n] += 1
        for n in in_pool:
            censored[min(n, self.max_len)] += 1
        at_risk = np.cumsum(deaths[::-1])[::-1] + np.cumsum(censored[::-1])[::-1][1:]   # known to reach x
        hazard = np.divide(deaths, at_risk, out=np.ones_like(deaths), where=at_risk > 0)
        surv = np.concatenate(([1.0], np.cumprod(1.0 - np.clip(hazard, 0.0, 1.0))))      # P(D > x)
        tail = np.cumsum(surv[::-1])[::-1]                                               # sum over y >= x
        return np.divide(tail[:-1], surv[:-1], out=np.ones(self.max_len), where=surv[:-1] > 1e-12)

    def expected_remaining(self, attained: int) -> float:
        """E[D - a | D > a] in tokens, for a job that has generated `attained` tokens (at least one more)."""
        return max(1.0, float(self.remaining[min(attained, self.max_len - 1)]))
