"""Each client's share of what the server bounds for all of them: the broker's queue of requests and
the KV pool's reservations (orca_mq.server.broker, orca_mq.sched.orca).

Who a client is (`client_name`): its API key where the server has keys (every connection with it),
else its connection; a gateway's end clients (the HTTP API's: each end client's key, else its
connection) are each their own under the gateway's name, the gateway naming them (`on_behalf_of`).

When a client may take more (`FairShare.allows`): a client holding `held` of `capacity` units, `total`
of them held by all, may take `need` more when it holds none (every client may start), or it stays
within its fair share, capacity / (clients + 1) (a share kept for the next client), or it leaves
`headroom` units free: no client can take what the next one needs to start, and a lone client loses
only the headroom (server.client_headroom; 0: no shares). Whether the units exist at all is the
caller's own check.
"""
from __future__ import annotations

from dataclasses import dataclass

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
