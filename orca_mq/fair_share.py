"""Each client's share of what the server bounds for all of them: the broker's queue of requests, the
KV pool's reservations (orca_mq.server.broker, orca_mq.sched.orca) and an iteration's rows
(`in_turn`, orca_mq.sched.base).

Who a client is (`client_name`): its API key where the server has keys (every connection with it),
else its connection; a gateway's end clients (the HTTP API's: each end client's key, else its
connection) are each their own under the gateway's name, the gateway naming them (`on_behalf_of`).

When a client may take more (`FairShare.allows`): a client holding `held` of `capacity` units, `total`
of them held by all, may take `need` more when it holds none (every client may start), or it stays
within its fair share, capacity / (clients + 1) (a share kept for the next client), or it leaves
`headroom` units free: no client can take what the next one needs to start, and a lone client loses
only the headroom (server.client_headroom; 0: no shares). Whether the units exist at all is the
caller's own check.

An iteration's rows (`in_turn`, scheduler.client_rows): on a CPU each row costs the sampler's passes
over the vocabulary and its log probabilities, closing plans and penalties, so one client's 16 choices
slow every other client's tokens (tools/bench_fairness.py); with a cap, no client keeps more rows in
an iteration than both the cap and the most another client has, the rest waiting a later iteration. Its
default (auto) is 2 on a CPU and no cap on CUDA, where a row is nearly free and a cap only shrinks batches.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orca_mq.sched.request import Request

MAX_LABEL_CHARS = 256   # an end client's name, as a gateway gives it


def client_name(identity: bytes, key_id: str, label: str) -> str:
    """The client a request counts for: its key (`key_id`, "#i" for the server's i-th key) or its
    connection's identity, and the end client its gateway named (`label`), if any."""
    owner = key_id or identity.hex()
    return f"{owner}/{label}" if label else owner


@dataclass(frozen=True, slots=True)
class FairShare:
    capacity: int
    headroom: int    # units a client holding some may not take past its fair share

    @classmethod
    def of(cls, capacity: int, fraction: float) -> "FairShare":
        return cls(capacity, int(capacity * fraction))

    def allows(self, held: int, total: int, need: int, clients: int) -> bool:
        """Whether a client holding `held` may take `need` more, `total` held by all and `clients`
        clients (it among them) holding any."""
        return (held == 0 or not self.headroom or held + need <= self.capacity // (clients + 1)
                or total + need <= self.capacity - self.headroom)


def in_turn(batch: list["Request"], cap: int, in_flight: Iterable[list["Request"]] = ()) -> list["Request"]:
    """`batch` with no client's requests outnumbering every other client's, past `cap` (0: no cap): a
    client with more than both `cap` and the most any other client has in the batch or in an iteration
    `in_flight` (another pipeline stage's, one planned ahead) keeps the larger of the two, its first in
    the batch's order (the policy's: ORCA's earliest, FastServe's highest queue); its others wait for a
    later iteration and their places are not given to others. So one client's many rows cannot make
    another's iterations cost many times its own, and clients of equal counts (one user's parallel
    connections) run whole."""
    if not cap or len(batch) <= cap:
        return batch
    rows: Counter[str] = Counter(r.client for r in batch)
    present = dict(rows)
    for flight in in_flight:
        for client, n in Counter(r.client for r in flight).items():
            present[client] = max(present.get(client, 0), n)
    if len(present) < 2:
        return batch
    # only the client with the most can outnumber every other: the rest are within the most
    (_, top), (second, _) = heapq.nlargest(2, ((n, c) for c, n in present.items()))
    limit = max(cap, second)
    if rows[top] <= limit:
        return batch
    out, kept = [], 0
    for r in batch:
        if r.client == top:
            if kept == limit:
                continue
            kept += 1
        out.append(r)
    return out
