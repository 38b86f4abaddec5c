"""One figure per benchmark run (or a side-by-side of several): the distributions of TTFT, TPOT,
ITL and end-to-end latency, as empirical CDFs, one line per run."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orca_mq.bench.metrics import is_ok, per_request_latencies

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("jct", "end-to-end latency"))


def latency_series(records: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {key: [] for key, _ in PANELS}
    for rec in records:
        if not is_ok(rec):
            continue
        lat = per_request_latencies(rec)
        out["itl"].extend(lat["itl"])
        for key in ("ttft", "tpot", "jct"):
            if lat[key] is not None:
                out[key].append(lat[key])
    return out


def plot_cdfs(runs: Mapping[str, Sequence[Mapping[str, Any]]], out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.4))
    for label, records in runs.items():
        series = latency_series(records)
        for ax, (key, name) in zip(axes, PANELS):
            values = np.sort(np.asarray(series[key]) * 1000.0)
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label)
            ax.set_title(name)
            ax.set_xlabel("ms")
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
