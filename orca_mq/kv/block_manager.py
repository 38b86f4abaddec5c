"""The scheduler side of the KV manager: which blocks of the device and host pools each request
holds, the prefix cache over them, the blocks reserved for the requests that started (ORCA's
`n_rsrv`, FastServe's admission), and the copies between the tiers that the next plan carries.

Prefix caching (`engine.prefix_caching`): a full block whose K/V has been computed (its iteration
came back) is published under its prefix hash (prefix.py); a request that starts takes the
longest run of its prompt's blocks found in the cache by reference instead of computing them (up
to the block before its last prompt token: that token is computed to sample from), and one whose
prompt is still to be fed takes blocks published meanwhile. Blocks nobody references stay cached
until an allocation needs them, least recently released first (tier.py); with a host tier
(FastServe) an evicted one is copied there when there is room, and uploaded again on a later hit.
The cache lives here, with the block tables: every pipeline stage keeps its own layers' K/V under
the same block ids.

The reservation counts what the pool must still be able to give: `n_rsrv` = referenced device
blocks + the blocks each started request may still allocate (its maximum, in blocks, less those
it holds on the device). A shared block counts once, so a request that reuses a block another one
holds reserves only the blocks it still needs; allocation never fails while n_rsrv <= the pool.

Swaps: every stage applies a plan's offloads before its uploads, so a device block freed (or
evicted) by an offload may receive an upload or new K/V in the same plan; host blocks an upload
reads, and host copies the plan makes, are pinned until the plan is sent (`take_swaps`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orca_mq.kv.pool import PoolSize
from orca_mq.kv.prefix import extend_chain
from orca_mq.kv.tier import KVAllocationError, Tier

if TYPE_CHECKING:
    from orca_mq.sched.request import Request

__all__ = ["BlockManager", "KVAllocationError", "Match"]


@dataclass(slots=True)
class Match:
    """A starting request's cached prefix: (on the host, block) per block, in order."""
    hits: list[tuple[bool, int]] = field(default_factory=list)
    held: bool = False

    @property
    def n_device(self) -> int:
        return sum(not on_host for on_host, _ in self.hits)

    @property
    def n_host(self) -> int:
        return sum(on_host for on_host, _ in self.hits)


class BlockManager:
    def __init__(self, size: PoolSize, seed: bytes | None = None, host: bool = True) -> None:
        self.size = size
        self.block_size = size.block_size
        self.seed = seed                                # prefix hash chain seed; None: no prefix caching
        self.device = Tier(size.device_blocks)
        self.host = Tier(size.host_blocks if host else 0)   # host=False: the stages keep no host pool (no swapping)
        self.started: set[str] = set()                  # requests holding a reservation
        self.pending = 0                                # blocks the started requests may still allocate on the device
        self.swap_out: list[tuple[int, int]] = []       # (device, host) copies the next plan carries
        self.swap_in: list[tuple[int, int]] = []        # (host, device)
        self._pins: list[int] = []                      # host blocks the next plan reads or writes
        self._dev_pins: list[int] = []                  # device blocks the next plan uploads into
        self.moved: set[str] = set()                    # requests whose KV the next plan copies: they move once a plan
        self._host_new: dict[bytes, int] = {}           # prefix hash -> host copy the next plan makes
        self.queries = 0                                # prompt tokens looked up in the cache
        self.hits = 0                                   # of those, tokens found

    # ------------------------------------------------------------ sizes

    def blocks_for(self, n_tokens: int) -> int:
        return self.size.blocks_for(n_tokens)

    @property
    def num_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Device blocks an allocation may take (free, or cached and unreferenced)."""
        return self.device.available

    @property
    def num_free_slots(self) -> int:
        return self.num_free_blocks * self.block_size

    @property
    def num_used_slots(self) -> int:
        return self.device.n_referenced * self.block_size

    @property
    def num_host_blocks(self) -> int:
        return self.host.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.host.available

    @property
    def n_rsrv(self) -> int:
        return self.device.n_referenced + self.pending

    # ------------------------------------------------------------ tables

    def table(self, request_id: str) -> list[int]:
        """Its device blocks ([] when it holds none there)."""
        return self.device.tables.get(request_id, [])

    def on_host(self, request_id: str) -> bool:
        return request_id in self.host.tables

    def held(self, request_id: str) -> int:
        """Blocks it holds, on whichever tier."""
        return len(self.device.tables.get(request_id, ())) or len(self.host.tables.get(request_id, ()))

    def movable(self, request_id: str) -> bool:
        """Whether its KV may be offloaded or uploaded by the next plan: not if that plan already
        copies it (a stage copies all offloads before all uploads, so a second move would read
        what the first has not written yet), nor if it reads a block an upload of that plan fills."""
        if request_id in self.moved:
            return False
        return not self._dev_pins or set(self._dev_pins).isdisjoint(self.device.tables.get(request_id, ()))

    def freed_by_offload(self, request_id: str) -> int:
        """Device blocks its offload would make available: those no other request holds."""
        return sum(self.device.ref[b] == 1 for b in self.table(request_id))

    def ensure(self, request_id: str, n_tokens: int) -> list[int]:
        """Grow its device block table to hold n_tokens tokens; returns the table."""
        table = self.device.tables.setdefault(request_id, [])
        missing = -(-n_tokens // self.block_size) - len(table)   # blocks_for, inlined: once per row and iteration
        if missing > 0:
            if missing > self.num_free_blocks:
                raise KVAllocationError(f"request {request_id}: needs {missing} more KV blocks, {self.num_free_blocks} free")
            table.extend(self._take(missing))
            self._grew(request_id, missing)
        return table

    # ------------------------------------------------------------ starting, reuse, publishing

    def match(self, req: "Request") -> Match:
        """The longest cached prefix of its prompt (pure), leaving its last prompt token to compute."""
        hashes = self._prompt_hashes(req)
        m = Match()
        for h in hashes:
            if (b := self.device.index.get(h)) is not None:
                m.hits.append((False, b))
            elif (b := self.host.index.get(h)) is not None:
                m.hits.append((True, b))
            else:
                break
        return m

    def hold(self, m: Match) -> None:
        """Pin the match's blocks while the request is considered: no eviction or offload frees them."""
        for on_host, b in m.hits:
            (self.host if on_host else self.device).acquire(b)
        m.held = True

    def let_go(self, m: Match) -> None:
        for on_host, b in m.hits:
            (self.host if on_host else self.device).drop(b)
        m.held = False

    def n_rsrv_after(self, m: Match, blocks: int) -> int:
        """n_rsrv once a request with held match m and a reservation of `blocks` starts."""
        return self.n_rsrv + blocks - m.n_device

    def start(self, req: "Request", m: Match, blocks: int) -> None:
        """The request starts with its held match as the head of its table (host hits uploaded by
        the next plan) and `blocks` reserved."""
        rid = req.request_id
        if not m.held:
            self.hold(m)
        fresh = iter(self._take(m.n_host))
        table = []
        for on_host, b in m.hits:
            if on_host:
                d = next(fresh)
                self._upload(b, d)
                self._pins.append(b)          # the hold's reference, kept until the plan is sent
                b = d
            table.append(b)
        self.device.tables[rid] = table
        if m.n_host:
            self.moved.add(rid)               # uploaded by the next plan: not offloaded by it too
        n = len(table) * self.block_size
        req.n_prompt_fed = req.cached_tokens = n
        req.kv_published = len(table)
        if self.seed is not None:
            self.queries += len(req.prompt_token_ids)
            self.hits += n
        self.reserve(req, blocks)

    def reserve(self, req: "Request", blocks: int) -> None:
        """`blocks` count against the pool until it leaves (or is unreserved): it is resident."""
        self.started.add(req.request_id)
        req.reserved_blocks = blocks
        self.pending += blocks - len(self.table(req.request_id))

    def unreserve(self, req: "Request") -> None:
        """Its reservation returns to the pool: its KV goes to the host tier (FastServe's offload)."""
        if req.request_id in self.started:
            self.started.discard(req.request_id)
            self.pending -= req.reserved_blocks - len(self.table(req.request_id))
        req.reserved_blocks = 0

    def reuse(self, req: "Request") -> None:
        """A started request whose prompt is still to be fed takes the blocks published meanwhile
        (by a request prefilling the same prefix) that come next in its chain."""
        table = self.device.tables.get(req.request_id)
        if self.seed is None or table is None or not req.prompt_pending or req.n_prompt_fed != len(table) * self.block_size:
            return
        hashes = self._prompt_hashes(req)
        while len(table) < len(hashes) and (b := self.device.index.get(hashes[len(table)])) is not None:
            self.device.acquire(b)
            table.append(b)
            self._grew(req.request_id, 1)
            req.n_prompt_fed += self.block_size
            req.cached_tokens += self.block_size
            self.hits += self.block_size
        req.kv_published = max(req.kv_published, len(table))

    def computed(self, req: "Request", n_tokens: int) -> None:
        """Its first n_tokens tokens' K/V is computed (their iterations came back): publish the full
        blocks among them."""
        table = self.device.tables.get(req.request_id)
        n_full = min(n_tokens // self.block_size, len(table or ()))
        if self.seed is None or table is None or n_full <= req.kv_published:
            return
        tokens = req.prompt_token_ids
        if n_full * self.block_size > len(tokens):
            tokens = tokens + req.output_token_ids
        hashes = extend_chain(req.kv_hashes, tokens, self.block_size, n_full, self.seed)
        for i in range(req.kv_published, n_full):
            self.device.publish(table[i], hashes[i])
        req.kv_published = n_full

    def release(self, req: "Request") -> None:
        """The request left: its references on both tiers and its reservation return to the pool."""
        rid = req.request_id
        self.unreserve(req)
        for b in self.device.tables.pop(rid, ()):
            self.device.drop(b)
        for b in self.host.tables.pop(rid, ()):
            self.host.drop(b)

    # ------------------------------------------------------------ tiers

    def offload(self, request_id: str) -> int:
        """Copy its KV to the host pool (by the next plan) and drop its device references; returns
        the blocks copied. Blocks other requests hold stay on the device for them; its cached
        blocks stay cached there, their host copies join the host cache."""
        if not self.movable(request_id):
            raise ValueError(f"request {request_id}: its KV already moves in the next plan")
        blocks = self.device.tables[request_id]
        host_blocks, _ = self.host.take(len(blocks))       # the host is the last tier: what it evicts is dropped
        self.moved.add(request_id)
        del self.device.tables[request_id]
        for d, hb in zip(blocks, host_blocks):
            self.swap_out.append((d, hb))
            h = self.device.hash_of.get(d)
            if h is not None and h not in self.host.index and h not in self._host_new:
                self._host_new[h] = hb        # cached on the host once the copy is sent; pinned till then
                self.host.acquire(hb)
                self._pins.append(hb)
            self.device.drop(d)
        self.host.tables[request_id] = host_blocks
        if request_id in self.started:
            self.pending += len(blocks)
        return len(blocks)

    def upload(self, request_id: str) -> int:
        """Bring its KV back to the device pool (by the next plan): blocks cached there are taken
        by reference, the others copied; returns the blocks copied."""
        if not self.movable(request_id):
            raise ValueError(f"request {request_id}: its KV already moves in the next plan")
        host_blocks = self.host.tables.pop(request_id)
        self.moved.add(request_id)
        table: list[int | None] = []
        for hb in host_blocks:
            h = self.host.hash_of.get(hb)
            d = None if h is None else self.device.index.get(h)
            if d is not None:
                self.device.acquire(d)
            table.append(d)
        copies = [i for i, d in enumerate(table) if d is None]
        for i, d in zip(copies, self._take(len(copies))):
            table[i] = d
            self._upload(host_blocks[i], d)
        self._pins.extend(host_blocks)      # its references, kept until the plan is sent
        self.device.tables[request_id] = table  # type: ignore[assignment]
        if request_id in self.started:
            self.pending -= len(table)
        return len(copies)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies of the plan being sent; the host blocks it reads or writes are released (and
        its host copies of cached blocks cached) only now, for later plans."""
        out, self.swap_out, self.swap_in = (self.swap_out, self.swap_in), [], []
        for h, hb in self._host_new.items():
            self.host.publish(hb, h)
        for hb in self._pins:
            self.host.drop(hb)
        for d in self._dev_pins:
            self.device.drop(d)
        self._host_new, self._pins, self._dev_pins, self.moved = {}, [], [], set()
        return out

    def _upload(self, hb: int, d: int) -> None:
        """Copy host block hb into device block d (cached there too if hb is); d keeps a pin until the
        plan is sent, so that nothing evicts (and copies out) a block before its upload lands."""
        self.swap_in.append((hb, d))
        self.device.acquire(d)
        self._dev_pins.append(d)
        if (h := self.host.hash_of.get(hb)) is not None:
            self.device.publish(d, h)

    def _take(self, n: int) -> list[int]:
        """n device blocks; cached ones evicted to make them are copied to the host tier when it has room."""
        blocks, evicted = self.device.take(n)
        for d, h in evicted:
            if self.host.available and h not in self.host.index and h not in self._host_new:
                (hb,), _ = self.host.take(1)
                self.swap_out.append((d, hb))
                self._host_new[h] = hb
                self._pins.append(hb)
        return blocks

    def _grew(self, request_id: str, n: int) -> None:
        if request_id in self.started:
            self.pending -= n

    def _prompt_hashes(self, req: "Request") -> list[bytes]:
        """Hashes of its prompt's blocks before the one holding its last token."""
        if self.seed is None:
            return []
        cap = (len(req.prompt_token_ids) - 1) // self.block_size
        return extend_chain(req.kv_hashes, req.prompt_token_ids, self.block_size, cap, self.seed)[:cap]

    # ------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        bs = self.block_size
        return {"n_slots": self.num_blocks * bs, "free_slots": self.num_free_slots, "used_slots": self.num_used_slots,
                "reserved_slots": self.n_rsrv * bs, "prefix_cache_slots": len(self.device.index) * bs,
                "prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits}

    def host_stats(self) -> dict[str, Any]:
        bs = self.block_size
        return {"host_slots": self.num_host_blocks * bs, "host_free_slots": self.host.available * bs,
                "host_used_slots": self.host.n_referenced * bs, "on_host": len(self.host.tables),
                "host_prefix_cache_slots": len(self.host.index) * bs}
