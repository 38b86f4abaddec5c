"""Lifecycle channel: launcher <-> broker/frontend/scheduler/workers, and broker notices."""
from __future__ import annotations

from dataclasses import dataclass

from orca_mq.protocol.codec import message


@message("ready")
@dataclass(slots=True)
class Ready:
    role: str
    pid: int
    kv_slots: int = 0   # a worker: its stage's KV pool (what the scheduler and frontend learn where it is measured)


@message("drain")
@dataclass(slots=True)
class Drain:
    """Stop accepting requests; answer `drained` once none is in flight."""


@message("drained")
@dataclass(slots=True)
class Drained:
    pass


@message("abort_all")
@dataclass(slots=True)
class AbortAll:
    reason: str


@message("fatal")
@dataclass(slots=True)
class Fatal:
    """A process died: the broker fails every in-flight request and refuses new ones."""

    reason: str


@message("client_gone")
@dataclass(slots=True)
class ClientGone:
    """The broker could not deliver to this client (ZMQ_ROUTER_MANDATORY): it disconnected."""

    client: bytes


@message("resume")
@dataclass(slots=True)
class Resume:
    """Every process is ready, at the start or after a restart: the broker serves requests (again)."""

    restarts: int


@message("progress")
@dataclass(slots=True)
class Progress:
    """A start-up step worth telling the operator about (e.g. FastServe's profiling)."""

    role: str
    what: str
