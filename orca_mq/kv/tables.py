"""Which blocks of the device and host pools each request holds, and the copies between the two
tiers that the next plan carries: offloads, uploads, and the cached blocks an allocation evicts
from the device, kept on the host when it has room. The block manager (block_manager.py) adds the
reservations and the prefix cache's lookups on top.

Swaps: every stage applies a plan's offloads before its uploads, so a device block freed (or
evicted) by an offload may receive an upload or new K/V in the same plan; host blocks an upload
reads, and host copies the plan makes, are pinned until the plan is sent (`take_swaps`).

Where every layer of the model slides, the blocks wholly before a request's window are given back
(block_manager.py): its table keeps their places as HOLE, so a position's block is still
table[position // block_size]; a hole is never read (the attention kernels start at the window).
"""
from __future__ import annotations

from orca_mq.kv.tier import Tier

HOLE = -1   # a table entry whose block left every layer's window and went back to the pool


class BlockTables:
    def __init__(self, device_blocks: int, host_blocks: int, window: int = 0) -> None:
        self.window = window                            # > 0: every layer slides, tables may have holes
        self.device = Tier(device_blocks)
        self.host = Tier(host_blocks)                   # 0: the stages keep no host pool (no swapping)
        self.swap_out: list[tuple[int, int]] = []       # (device, host) copies the next plan carries
        self.swap_in: list[tuple[int, int]] = []        # (host, device)
        self._pins: list[int] = []                      # host blocks the next plan reads or writes
        self._dev_pins: list[int] = []                  # device blocks the next plan uploads into
        self.moved: set[str] = set()                    # requests whose KV the next plan copies: they move once a plan
        self.replaced: set[str] = set()                 # requests uploaded since the planner looked: their tables are new lists
        self._host_new: dict[bytes, int] = {}           # prefix hash -> host copy the next plan makes

    # ------------------------------------------------------------ tables

    def table(self, request_id: str) -> list[int]:
        """Its device blocks ([] when it holds none there)."""
        return self.device.tables.get(request_id, [])

    def on_host(self, request_id: str) -> bool:
        return request_id in self.host.tables

    def held(self, request_id: str) -> int:
        """Blocks it holds, on whichever tier."""
        table = self.device.tables.get(request_id) or self.host.tables.get(request_id, ())
        return len(table) - table.count(HOLE) if self.window else len(table)

    def movable(self, request_id: str) -> bool:
        """Whether its KV may be offloaded or uploaded by the next plan: not if that plan already
        copies it (a stage copies all offloads before all uploads, so a second move would read
        what the first has not written yet), nor if it reads a block an upload of that plan fills."""
        if request_id in self.moved:
            return False
        return not self._dev_pins or set(self._dev_pins).isdisjoint(self.device.tables.get(request_id, ()))

    def freed_by_offload(self, request_id: str) -> int:
        """Device blocks its offload would make available: those no other request holds."""
        return sum(b != HOLE and self.device.ref[b] == 1 for b in self.table(request_id))

    # ------------------------------------------------------------ copies between the tiers

    def offload(self, request_id: str) -> int:
        """Copy its KV to the host pool (by the next plan) and drop its device references; returns
        the blocks copied. Blocks other requests hold stay on the device for them; its cached
        blocks stay cached there, their host copies join the host cache."""
        if not self.movable(request_id):
            raise ValueError(f"request {request_id}: its KV already moves in the next plan")
        table = self.device.tables[request_id]
        blocks = [b for b in table if b != HOLE] if self.window else table
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
        self.host.tables[request_id] = [HOLE] * (len(table) - len(blocks)) + host_blocks   # holes lead
        self._grew(request_id, -len(blocks))
        return len(blocks)

    def upload(self, request_id: str) -> int:
        """Bring its KV back to the device pool (by the next plan): blocks cached there are taken
        by reference, the others copied; returns the blocks copied."""
        if not self.movable(request_id):
            raise ValueError(f"request {request_id}: its KV already moves in the next plan")
        table: list[int | None] = self.host.tables.pop(request_id)   # type: ignore[assignment]
        holes = table.count(HOLE) if self.window else 0
        host_blocks: list[int] = table[holes:]   # type: ignore[assignment]
        table = [HOLE] * holes
        self.moved.add(request_id)
        for hb in host_blocks:
            h = self.host.hash_of.get(hb)
            d = None if h is None else self.device.index.get(h)
            if d is not None:
                self.device.acquire(d)
            table.append(d)
        copies = [i for i, d in enumerate(table) if d is None]
        for i, d in zip(copies, self._take(len(copies))):
            table[i] = d
            self._upload(host_blocks[i - holes], d)
        self._pins.extend(host_blocks)      # its references, kept until the plan is sent
        self.device.tables[request_id] = table  # type: ignore[assignment]
        self.replaced.add(request_id)
        self._grew(request_id, len(host_blocks))
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
        """Its device table grew by n blocks (shrank, n < 0): what a reservation counts (block_manager.py)."""
