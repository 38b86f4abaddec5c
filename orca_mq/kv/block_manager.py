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

Sliding windows (`window`, where every layer of the model slides): a row whose first new token is
at position p reads no key before p - window + 1, so the blocks wholly before that go back to the
pool (or the prefix cache) as the request grows, their places left as holes: a long generation holds
about a window of KV. Its reservation still counts them (they are its to take again), so no
request's admission changes. Models that mix local and global layers keep every block.

The block tables of both tiers and the copies between them that a plan carries are tables.py's.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from orca_mq.kv.pool import PoolSize
from orca_mq.kv.prefix import block_hash, extend_chain
from orca_mq.kv.request import KVRequest
from orca_mq.kv.tables import HOLE, BlockTables
from orca_mq.kv.tier import KVAllocationError

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


class BlockManager(BlockTables):
    def __init__(self, size: PoolSize, seed: bytes | None = None, host: bool = True, window: int = 0) -> None:
        super().__init__(size.device_blocks, size.host_blocks if host else 0, window)   # host=False: no host pool
        self.size = size
        self.block_size = size.block_size
        self.seed = seed                                # prefix hash chain seed; None: no prefix caching
        self.started: set[str] = set()                  # requests holding a reservation
        self.pending = 0                                # blocks the started requests may still allocate on the device
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

    # ------------------------------------------------------------ growing

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

    def _slide(self, request_id: str, table: list[int], first: int) -> None:
        """With a window, the blocks wholly before the window of its next row (whose first new token is at
        position `first`) go back to the pool, their places kept as holes."""
        if not self.window:
            return
        dropped = 0
        gone = min((first - self.window + 1) // self.block_size, len(table))
        for i in range(gone - 1, -1, -1):   # from the newest: the holes already made lead
            if table[i] == HOLE:
                break
            self.device.drop(table[i])
            table[i] = HOLE
            dropped += 1
        if dropped:
            self._grew(request_id, -dropped)

    def wire(self, table: list[int]) -> list[int]:
        """The table a plan carries: holes name block 0, which nothing reads there."""
        return [max(b, 0) for b in table] if self.window else list(table)

    def trim(self, request_id: str, n_tokens: int) -> None:
        """Speculative decoding's rollback: the blocks past n_tokens' that only rejected draft tokens
        wrote go back to the pool (their K/V is beyond the request's length; its reservation keeps them
        counted for it)."""
        table = self.device.tables.get(request_id)
        extra = 0 if table is None else len(table) - -(-n_tokens // self.block_size)
        for _ in range(max(extra, 0)):
            self.device.drop(table.pop())   # type: ignore[union-attr]  (holes lead: rollback never reaches them)
        if extra > 0 and request_id in self.started:
            self.pending += extra

    # ------------------------------------------------------------ starting, reuse, publishing

    def match(self, req: KVRequest) -> Match:
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

    def start(self, req: KVRequest, m: Match, blocks: int) -> None:
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
        self._slide(rid, table, n)

    def reserve(self, req: KVRequest, blocks: int) -> None:
        """`blocks` count against the pool until it leaves (or is unreserved): it is resident."""
        self.started.add(req.request_id)
        req.reserved_blocks = blocks
        self.pending += blocks - self._held_here(req.request_id)

    def unreserve(self, req: KVRequest) -> None:
        """Its reservation returns to the pool: its KV goes to the host tier (FastServe's offload)."""
        if req.request_id in self.started:
            self.started.discard(req.request_id)
            self.pending -= req.reserved_blocks - self._held_here(req.request_id)
        req.reserved_blocks = 0

    def reuse(self, req: KVRequest) -> None:
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
        self._slide(req.request_id, table, req.n_prompt_fed)

    def computed(self, req: KVRequest, n_tokens: int, first: int | None = None) -> None:
        """Its first n_tokens tokens' K/V is computed (their iterations came back): publish the full
        blocks among them; with a window, then give back those before the window of its next row (at
        position `first`, n_tokens unless given): every iteration that read them has come back, later
        ones start after."""
        table = self.device.tables.get(req.request_id)
        if table is None:
            return
        n_full = min(n_tokens // self.block_size, len(table))
        if self.seed is not None and n_full > req.kv_published:
            # only the tokens of the blocks not hashed yet (the whole history is long, a block is not)
            lo, hi, prompt = len(req.kv_hashes) * self.block_size, n_full * self.block_size, req.prompt_token_ids
            tokens = prompt[lo:hi] if hi <= len(prompt) else prompt[lo:] + req.output_token_ids[max(lo - len(prompt), 0):hi - len(prompt)]
            hashes = extend_chain(req.kv_hashes, tokens, self.block_size, n_full, self.seed, lo)
            for i in range(req.kv_published, n_full):
                if table[i] != HOLE:   # a block of a cache hit that left the window before it was published
                    self.device.publish(table[i], hashes[i])
            req.kv_published = n_full
        self._slide(req.request_id, table, n_tokens if first is None else first)

    def decoded(self, reqs: list[KVRequest], counts: list[int]) -> None:
        """computed(req, n) for decode rows whose K/V reached a new full block: in the usual case (the block
        after the last published, all output tokens, no window) that block is hashed and published here
        (a batch of 256 rows fills 16 blocks an iteration), else computed() takes the row."""
        bs, tables = self.block_size, self.device.tables
        for req, n in zip(reqs, counts):
            k, hashes, table = req.kv_published, req.kv_hashes, tables.get(req.request_id)
            lo = k * bs - len(req.prompt_token_ids)   # the block's first position among the output tokens
            if self.window or table is None or n // bs != k + 1 or len(hashes) != k or lo < 0 or len(table) <= k:
                self.computed(req, n)
                continue
            h = block_hash(hashes[-1] if hashes else self.seed, array("q", req.output_token_ids[lo:lo + bs]).tobytes())
            hashes.append(h)
            if table[k] != HOLE:
                self.device.publish(table[k], h)
            req.kv_published = k + 1

    def release(self, req: KVRequest) -> None:
        """The request left: its references on both tiers and its reservation return to the pool."""
        rid = req.request_id
        self.unreserve(req)
        self.replaced.discard(rid)
        for b in self.device.tables.pop(rid, ()):
            if b != HOLE:
                self.device.drop(b)
        for b in self.host.tables.pop(rid, ()):
            if b != HOLE:
                self.host.drop(b)

    def _grew(self, request_id: str, n: int) -> None:
        if request_id in self.started:
            self.pending -= n

    def _held_here(self, request_id: str) -> int:
        """Device blocks it holds (its table less the holes)."""
        table = self.table(request_id)
        return len(table) - table.count(HOLE) if self.window else len(table)

    def _prompt_hashes(self, req: KVRequest) -> list[bytes]:
        """Hashes of its prompt's blocks before the one holding its last token (none to look up
        for a request that computes its whole prompt)."""
        if self.seed is None or not req.reads_prefix_cache:
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
