"""Scheduling policies by name (`scheduler.policy`): each policy module registers its class."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from orca_mq.sched.base import Scheduler

S = TypeVar("S", bound="type[Scheduler]")
POLICIES: dict[str, "type[Scheduler]"] = {}


def register(name: str) -> Callable[[S], S]:
    def add(cls: S) -> S:
        POLICIES[name] = cls
        return cls
    return add
