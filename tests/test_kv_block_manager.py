"""The block manager under any sequence of admit / grow / abort / finish / preempt (offload) /
upload / plan sent, with prefix caching and a host tier (hypothesis): a fake memory applies each
plan's copies as a stage does (offloads, then uploads, then the compute writes), and after every
step the bookkeeping must be exact and every block a request reads must hold its own tokens' K/V.

Invariants: a block is free, referenced or idle (cached), never two of these; its count equals
the live references (tables, pins); only unreferenced cached blocks are evicted (a referenced one
keeps its hash and content); the reservation equals referenced blocks plus what started requests
may still allocate; nothing leaks once every request has left.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_mq.kv.block_manager import BlockManager
from orca_mq.kv.pool import PoolSize
from orca_mq.kv.prefix import chain_seed
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched.request import Phase, Request

BS = 2
HEADS = [[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 3, 3], [4, 4, 4, 4, 4, 4]]   # shared prefixes


class Model:
    """Drives a BlockManager as the schedulers do and checks it against a fake KV memory."""

    def __init__(self, device: int, host: int) -> None:
        self.bm = BlockManager(PoolSize(BS, device, host), chain_seed("test"), host=host > 0)
        self.dev: dict[int, tuple[int, ...]] = {}    # block -> the tokens whose K/V it holds (up to its end)
        self.host: dict[int, tuple[int, ...]] = {}
        self.reqs: dict[str, Request] = {}
        self.chain: dict[bytes, tuple[int, ...]] = {}   # prefix hash -> the tokens it stands for
        self.n = 0
        self.sent = False                          # a plan was sent (its copies landed) since the last check

    def tokens(self, req: Request) -> list[int]:
        return req.prompt_token_ids + req.output_token_ids

    # ---------------------------------------------------------------- ops

    def admit(self, head: int, tail: list[int], max_tokens: int) -> None:
        bm = self.bm
        req = Request(f"r{self.n}", HEADS[head] + tail, SamplingParams(max_tokens=max_tokens))
        self.n += 1
        m = bm.match(req)
        bm.hold(m)
        size = bm.blocks_for(req.max_total_tokens)
        if bm.n_rsrv_after(m, size) > bm.num_blocks or m.n_host > bm.num_free_blocks:
            bm.let_go(m)
            return
        bm.start(req, m, size)
        assert req.n_prompt_fed == len(m.hits) * BS < len(req.prompt_token_ids)   # the last token is computed
        self.reqs[req.request_id] = req

    def step(self, i: int, chunk: int, token: int) -> None:
        """One iteration of request i: its next prompt chunk, or one token; sent and returned."""
        req = self.pick(i, on_device=True)
        if req is None:
            return
        bm = self.bm
        bm.reuse(req)
        if req.prompt_pending:
            start, end = req.n_prompt_fed, min(len(req.prompt_token_ids), req.n_prompt_fed + chunk)
        elif len(req.output_token_ids) < req.params.max_tokens:
            start = len(self.tokens(req)) - 1
            end = start + 1
        else:
            return
        assert bm.blocks_for(end) - len(bm.table(req.request_id)) <= bm.num_free_blocks, "n_rsrv <= the pool and no block"
        table = list(bm.ensure(req.request_id, end))
        self.send()
        toks = self.tokens(req)
        for b in range(-(-start // BS)):                # what it reads
            assert self.dev.get(table[b]) == tuple(toks[:min(start, (b + 1) * BS)]), f"{req.request_id} reads a wrong block {b}"
        for b in range(start // BS, -(-end // BS)):     # what it writes
            self.dev[table[b]] = tuple(toks[:min(end, (b + 1) * BS)])
        if req.prompt_pending:
            req.n_prompt_fed = end
        if not req.prompt_pending:
            req.output_token_ids.append(token)
            req.phase = Phase.INCREMENT
        bm.computed(req, end)
        for b, h in enumerate(req.kv_hashes):
            self.chain[h] = tuple(toks[:(b + 1) * BS])

    def leave(self, i: int) -> None:
        req = self.pick(i)
        if req is not None:
            self.bm.release(req)
            del self.reqs[req.request_id]

    def offload(self, i: int) -> None:
        req = self.pick(i, on_device=True)
        if req is not None and self.bm.movable(req.request_id) and self.bm.held(req.request_id) <= self.bm.num_free_host_blocks:
            self.bm.unreserve(req)   # as FastServe's policies do: only resident jobs hold a reservation
            self.bm.offload(req.request_id)

    def upload(self, i: int) -> None:
        req = self.pick(i, on_device=False)
        bm = self.bm
        if req is not None and bm.movable(req.request_id):
            size = bm.blocks_for(req.max_total_tokens)
            if bm.n_rsrv + size <= bm.num_blocks:
                bm.reserve(req, size)
                bm.upload(req.request_id)

    def send(self) -> None:
        """The plan is sent: every stage copies its offloads, then its uploads."""
        self.sent = True
        out, into = self.bm.take_swaps()
        for d, h in out:
            self.host[h] = self.dev.get(d)
        for h, d in into:
            self.dev[d] = self.host.get(h)

    def pick(self, i: int, on_device: bool | None = None) -> Request | None:
        reqs = [r for r in self.reqs.values() if on_device is None or self.bm.on_host(r.request_id) != on_device]
        return reqs[i % len(reqs)] if reqs else None

    # ---------------------------------------------------------------- checks

    def check(self) -> None:
        bm = self.bm
        pins = Counter(bm._pins)
        for tier, extra in ((bm.device, Counter(bm._dev_pins)), (bm.host, pins)):
            refs = Counter(b for t in tier.tables.values() for b in t) + extra
            free, idle = list(tier.free), set(tier.idle)
            assert len(free) == len(set(free)) and not set(free) & idle
            for b in range(tier.num_blocks):
                assert tier.ref[b] == refs[b], f"block {b}: count {tier.ref[b]}, {refs[b]} references"
                assert (b in free) + (b in idle) + (refs[b] > 0) == 1, f"block {b} in two states or none"
                assert (b in idle) == (refs[b] == 0 and b in tier.hash_of)
            assert tier.n_referenced == sum(r > 0 for r in tier.ref)
            assert {b: h for h, b in tier.index.items()} == tier.hash_of
        assert bm.pending == sum(r.reserved_blocks - len(bm.table(r.request_id)) for r in self.reqs.values())
        assert bm.started == {r.request_id for r in self.reqs.values() if r.reserved_blocks}
        if self.sent and not (bm.swap_out or bm.swap_in):   # cached and held blocks hold what their hash and owner say
            for mem, tier in ((self.dev, bm.device), (self.host, bm.host)):
                for b, h in tier.hash_of.items():
                    assert mem.get(b) == self.chain[h], f"cached block {b} holds {mem.get(b)}, not {self.chain[h]}"
            for req in self.reqs.values():
                toks = self.tokens(req)
                tier, mem = (bm.host, self.host) if bm.on_host(req.request_id) else (bm.device, self.dev)
                for b, block in enumerate(tier.tables.get(req.request_id, ())[:req.kv_published]):
                    assert mem.get(block) == tuple(toks[:(b + 1) * BS]), f"{req.request_id} lost block {b}"


def random_ops(rnd, n: int) -> list[tuple]:
    """n operations, steps the most frequent (hypothesis drives `rnd`, and shrinks what it finds)."""
    ops: list[tuple] = []
    for _ in range(n):
        op = rnd.choice(["admit", "admit", "step", "step", "step", "step", "leave", "offload", "upload", "send"])
        if op == "admit":
            ops.append((op, rnd.randrange(len(HEADS)), [rnd.randint(1, 3) for _ in range(rnd.randint(0, 5))], rnd.randint(1, 6)))
        elif op == "step":
            ops.append((op, rnd.randrange(64), rnd.randint(1, 5), rnd.randint(1, 3)))
        elif op == "send":
            ops.append((op,))
        else:
            ops.append((op, rnd.randrange(64)))
    return ops


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rnd=st.randoms(use_true_random=False), n=st.integers(10, 120), device=st.integers(4, 16),
       host=st.sampled_from([0, 4, 16]))
def test_block_manager_stays_exact_under_any_sequence(rnd, n, device, host):
    model = Model(device, host)
    for op, *args in random_ops(rnd, n):
        if op in ("offload", "upload") and not host:
            continue
        getattr(model, op)(*args)
        model.check()
        model.sent = False
    for rid in list(model.reqs):
        model.leave(0)
    model.send()
    model.check()
    bm = model.bm
    assert bm.n_rsrv == 0 and bm.pending == 0 and not bm.started
    for tier in (bm.device, bm.host):
        assert tier.n_referenced == 0 and tier.available == tier.num_blocks and not tier.tables
