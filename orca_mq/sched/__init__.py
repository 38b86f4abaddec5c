"""Iteration-level scheduling: the policies over one request pool and the KV block tables.

No code outside this package names a policy: it drives the chosen one through `step()` and asks
its class through its hooks (`swaps_kv`, `needs_profile`) what the policy needs. `srpt` is an
oracle for benchmarks (it knows output lengths), not a policy to serve with.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from orca_mq.sched import fastserve, orca, request_level, srpt  # noqa: F401  (each registers its policy)
from orca_mq.sched.base import Scheduler
from orca_mq.sched.events import StepOutput, TokenColumns, TokenEvent, Tokens, events_of
from orca_mq.sched.registry import POLICIES

if TYPE_CHECKING:
    from orca_mq.config import Config
    from orca_mq.models.info import ModelInfo

__all__ = ["POLICIES", "Scheduler", "StepOutput", "TokenColumns", "TokenEvent", "Tokens", "events_of", "make_scheduler", "policy_class"]


def policy_class(name: str) -> type[Scheduler]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduler.policy {name!r} ({' | '.join(POLICIES)})") from None


def make_scheduler(cfg: "Config", info: "ModelInfo") -> Scheduler:
    return policy_class(cfg.scheduler.policy)(cfg, info)
