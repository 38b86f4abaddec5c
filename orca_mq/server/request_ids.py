"""Request ids belong to their client: the frontend names every request it accepts with an internal id
unique within the server, and the scheduler and the workers only ever see that one.

Two clients may use the same request id at the same time; a client that vanishes takes its ids
with it, and whatever the scheduler still sends for them (the abort of a request that was running)
finds no owner, so it can never reach a new client that reuses the id.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from orca_mq.errors import InvalidRequest

RECENT = 10_000    # finished requests whose client ids a stats record can still show (the scheduler keeps 10,000 iterations)

Key = tuple[bytes, str]   # (client identity, the client's request id)


@dataclass(slots=True)
class RequestIds:
    live: dict[Key, str] = field(default_factory=dict)            # admitting or active: (client, id) -> internal id
    owner: dict[str, Key] = field(default_factory=dict)           # internal id -> (client, id), live ones
    by_client: dict[bytes, set[str]] = field(default_factory=dict)
    recent: OrderedDict[str, Key] = field(default_factory=OrderedDict)  # bounded: names in stats records
    _next: itertools.count[int] = field(default_factory=itertools.count)

    def new(self, client: bytes, request_id: str) -> str:
        key = (client, request_id)
        if key in self.live:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        iid = f"#{next(self._next)}"
        self.live[key] = iid
        self.owner[iid] = key
        self.by_client.setdefault(client, set()).add(iid)
        self.recent[iid] = key
        if len(self.recent) > RECENT:
            self.recent.popitem(last=False)
        return iid

    def lookup(self, client: bytes, request_id: str) -> str | None:
        return self.live.get((client, request_id))

    def of_client(self, client: bytes) -> list[str]:
        return sorted(self.by_client.get(client, ()))

    def release(self, iid: str) -> None:
        key = self.owner.pop(iid, None)
        if key is None:
            return
        del self.live[key]
        owned = self.by_client[key[0]]
        owned.discard(iid)
        if not owned:
            del self.by_client[key[0]]

    def name(self, iid: str, client: bytes) -> str:
        """How `client` sees a request in a stats record: its own id for its own requests, the internal id otherwise."""
        key = self.recent.get(iid)
        return key[1] if key is not None and key[0] == client else iid
