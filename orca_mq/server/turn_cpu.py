"""Where the scheduler process's main thread spends its CPU, by part of its turn (issue 42 item 5): thread
CPU seconds since the process started, in its stats (`scheduler.turn_cpu_s`); tools/bench_control_plane.py
gives each per generated token beside the process's whole CPU. What the parts leave out of `main` is the
event loop and the sockets' receiving around them; the process's other threads (ZeroMQ's I/O thread, the
grammar pool) are the whole less `main`. One clock read between parts: ~1 µs a turn."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

PARTS = ("decode", "step", "plan_frames", "token_frames")   # frames decoded; apply + plan; plans encoded + sent; tokens


@dataclass(slots=True)
class TurnCpu:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def since(self, part: str, start: float) -> float:
        """The thread's CPU since `start` goes to `part`; returns the clock now (the next part's start)."""
        now = time.thread_time()
        self.seconds[part] += now - start
        return now

    def to_dict(self) -> dict[str, float]:
        return self.seconds | {"main": time.thread_time()}
