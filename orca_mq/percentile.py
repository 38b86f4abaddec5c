"""One percentile for every figure the project reports (a served run's p99, a simulated one, a
process's own timings in its stats): linear interpolation between the closest ranks, numpy's default
method, in plain Python so that the light processes (the client, the logs) need no numpy."""
from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0 <= p <= 100) of `values`; None when there are none."""
    xs = sorted(values)
    if not xs:
        return None
    h = (len(xs) - 1) * p / 100
    lo = int(h)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (h - lo) * (xs[hi] - xs[lo]))
