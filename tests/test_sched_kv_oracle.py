"""Every policy driven through its own loop (`step`) over random interleavings of arrivals, aborts,
failures and results, on a fake engine whose KV memory is checked: each slot holds the identity of the
prefix its K/V was computed from, and every row must read, through its block table and within its window,
the K/V of its own tokens after the plan's copies (offloads, then uploads; a plan's copies may land as
early as its planning, after every earlier plan's, as the stages' copy threads may). So a block freed,
shared, cached, offloaded, uploaded or slid away wrongly fails here, as does a request that ends twice or
never, a leaked block or reservation, a plan past the token budget, or a stall. Small pools make FastServe
offload and upload, prefix caching share blocks, async scheduling (ORCA, SRPT) plan ahead; embeddings,
log probabilities, stop tokens, constrained (fake grammar) and speculative rows ride along.
ORCA_FUZZ_SEEDS sets how many workloads run (default 60: a few seconds).
A tool: `python tests/test_sched_kv_oracle.py LO HI` runs seeds LO..HI and prints the failing ones."""
from __future__ import annotations

import os
import random
import sys
import traceback
from collections import Counter, deque

import numpy as np
import pytest

from orca_mq.config import load_config
from orca_mq.kv.tables import HOLE
from orca_mq.models.info import ModelInfo
from orca_mq.protocol.iteration import IterationResult
from orca_mq.protocol.pooling import PoolingParams
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.sched import make_scheduler
from orca_mq.sched.profiler import IterationProfile
from orca_mq.sched.request import Request

INFO = ModelInfo(path="", arch="llama", vocab_size=1000, hidden_size=8, n_layers=2, n_heads=2, n_kv_heads=1,
                 intermediate_size=16, norm_eps=1e-5, context_length=4096, eos_token_ids=[2])
PROFILE = IterationProfile([(1, 0.001), (1000, 1.0)], [(1, 0.010), (64, 0.020)])



class FakeGrammar:
    def __init__(self, rnd):
        self.rnd, self.matcher, self.kind, self.released = rnd, None, "json", 0
        self.stop_token = rnd.randrange(3, 9)

    def prepare(self, budget):
        return budget is None or self.rnd.random() < 0.6

    def accept(self, token):
        assert not self.released
        return "stop" if token == self.stop_token else None

    def release(self):
        self.released += 1

    def report(self):
        return {"constraint": "json"}

    def fork(self):
        raise AssertionError("no matcher: no fork")


SLIDING = ModelInfo(**{**INFO.to_json(), "layer_kinds": ["sliding"] * 2, "sliding_window": 6})


class Engine:
    """A fake engine whose KV memory holds, per slot, the identity of the prefix it was computed from."""

    def __init__(self, sched, reqs):
        bm = sched.block_manager
        self.bs, self.window = bm.block_size, bm.window
        self.dev = [[None] * self.bs for _ in range(bm.num_blocks)]
        self.host = [[None] * self.bs for _ in range(max(bm.num_host_blocks, 1))]
        self.truth = {rid: list(r.prompt_token_ids) for rid, r in reqs.items()}
        self.done = set()
        self.queued = {}
        self.inactive = set()   # requests that finished: their rows' outputs are dropped

    def swaps(self, plan):
        """A plan's copies, after every earlier plan's (one FIFO copy thread per stage)."""
        if plan.iteration in self.done:
            return
        for it in sorted(self.queued):
            if it < plan.iteration and it not in self.done:
                self.swaps(self.queued[it])
        self.done.add(plan.iteration)
        for d, h in plan.swap_out:
            self.host[h] = list(self.dev[d])
        for h, d in plan.swap_in:
            self.dev[d] = list(self.host[h])

    def compute(self, s):
        truth, bs, table = self.truth[s.request_id], self.bs, s.block_table
        lo = max(0, s.start_pos - self.window + 1) if self.window else 0
        valid = True
        for pos in range(lo, s.start_pos):
            got = self.dev[table[pos // bs]][pos % bs]
            want = hash(tuple(truth[:pos + 1]))
            if got != want:
                valid = False
                assert s.request_id in self.inactive, f"{s.request_id}: position {pos} (block {table[pos // bs]}) reads K/V of another prefix"
        seq = truth[:s.start_pos]
        assert len(seq) == s.start_pos, (s.request_id, len(truth), s.start_pos)
        for i, tok in enumerate(s.token_ids):
            pos = s.start_pos + i
            if tok == -1:
                assert i == 0
                tok = truth[pos]
            else:
                if pos < len(truth) and s.draft == 0:
                    assert truth[pos] == tok, (s.request_id, pos, truth[pos], tok)
            seq.append(tok)
            self.dev[table[pos // bs]][pos % bs] = hash(tuple(seq)) if valid else "garbage"

    def sampled(self, rid, s, app):
        """The tokens the request gets (its verify row's kept drafts and the next)."""
        truth = self.truth[rid]
        p = s.seq_len - s.draft   # the position of the first sampled token
        del truth[p:]
        truth.extend(app)


def check_kv(sched):
    bm = sched.block_manager
    dev = bm.device
    refs = Counter()
    for rid, t in dev.tables.items():
        assert rid in sched.pool, f"table of {rid} not in pool"
        for b in t:
            if b != HOLE:
                refs[b] += 1
    # pins only while a plan is being built: after step they are taken (unless no plan)
    if not bm._dev_pins:
        for b in range(dev.num_blocks):
            assert dev.ref[b] == refs[b], f"device block {b}: ref {dev.ref[b]} vs tables {refs[b]}"
    pending = 0
    for rid in bm.started:
        req = sched.pool.get(rid)
        assert req is not None, f"started {rid} not in pool"
        pending += req.reserved_blocks - bm._held_here(rid)
        assert bm._held_here(rid) <= req.reserved_blocks or sched.block_manager.window, (rid, bm._held_here(rid), req.reserved_blocks)
    assert pending == bm.pending, f"pending {bm.pending} vs {pending}"
    assert bm.window or bm.n_rsrv <= bm.num_blocks, f"n_rsrv {bm.n_rsrv} > {bm.num_blocks}"
    for rid in bm.host.tables:
        assert rid in sched.pool, f"host table of {rid} not in pool"


def run(seed: int) -> None:
    rnd = random.Random(seed)
    name, kvp = rnd.choice([("orca", None), ("request", None), ("srpt", None), ("fastserve", "proactive"),
                            ("fastserve", "reactive"), ("fastserve", "defer")])
    spec = rnd.random() < 0.3
    n_workers = rnd.choice([1, 1, 2])
    asyncs = "off"
    if name in ("orca", "srpt") and n_workers == 1 and rnd.random() < 0.5:
        asyncs = "on"
    bs = rnd.choice([1, 2, 4])
    slots = rnd.choice([16, 32, 64, 256])
    budget = rnd.choice([0, 0, 1, 2, 5, 8, 24])
    max_bs = rnd.choice([1, 2, 3, 5, 8])
    host = rnd.choice([0, 8, 32, 4096])
    overrides = {"scheduler.policy": name, "scheduler.max_bs": max_bs, "scheduler.max_num_batched_tokens": budget,
                 "engine.n_workers": n_workers, "engine.block_size": bs, "engine.n_slots": slots,
                 "engine.host_slots": host, "fastserve.starve_limit": rnd.choice([0.02, 0.1, 1.0]),
                 "fastserve.min_free_blocks": rnd.choice([0, 2, 8]), "fastserve.burst_queues": rnd.choice([0, 2]), "fastserve.preempt_margin": rnd.choice([0.0, 0.0, 2.0]),
                 "speculative.method": "ngram" if spec else "off", "speculative.lookup_min": 1, "structured.plan_budget": rnd.choice([0, 100]),
                 "server.client_headroom": rnd.choice([0.0, 0.0625, 0.5]), "scheduler.client_rows": rnd.choice([0, 0, 1, 2]),
                 "engine.prefix_caching": rnd.random() < 0.8, "scheduler.async_scheduling": asyncs}
    if kvp:
        overrides["fastserve.kv_policy"] = kvp
    cfg = load_config(overrides=overrides)
    sched = make_scheduler(cfg, SLIDING if rnd.random() < 0.15 else INFO)
    profile_early = rnd.random() < 0.7 or slots < 2 * 65   # a pool too small for the increment probes is given one
    if sched.needs_profile and profile_early:
        sched.use_profile(PROFILE)
    bases = [[rnd.randrange(3, 9) for _ in range(40)] for _ in range(3)]
    n = rnd.randrange(1, 40)
    reqs = []
    t = 0.0
    for i in range(n):
        t += rnd.expovariate(rnd.choice([20, 200]))
        b = rnd.choice(bases)
        plen = rnd.randrange(1, 30)
        prompt = b[:plen] if rnd.random() < 0.7 else [rnd.randrange(3, 9) for _ in range(plen)]
        kind = rnd.random()
        pooling = None
        kw = {}
        if kind < 0.1:
            pooling = PoolingParams(rnd.choice(["last", "mean"]))
        elif kind < 0.2:
            kw["prompt_logprobs"] = 1
        elif kind < 0.3:
            kw["logprobs"] = 1
        elif kind < 0.4:
            kw["stop_token_ids"] = [rnd.randrange(3, 9)]
        elif kind < 0.45:
            kw["min_tokens"] = 1
        elif kind < 0.55:
            kw["grammar"] = FakeGrammar(rnd)
        mt = rnd.choice([rnd.randrange(1, 8), rnd.randrange(1, 60)])
        grammar = kw.pop("grammar", None)
        params = SamplingParams(max_tokens=mt, ignore_eos=rnd.random() < 0.5, **kw)
        r = Request(f"r{i}", prompt, params, arrival=t, client=f"c{rnd.randrange(3)}", pooling=pooling, grammar=grammar)
        fate = rnd.choice(["none", "none", "abort", "fail", "abort2"])
        reqs.append((r, fate, t + rnd.expovariate(20)))
    byid = {r.request_id: r for r, _, _ in reqs}
    pending = deque(sorted(reqs, key=lambda x: x[0].arrival))
    fates = {}
    in_flight = deque()
    engine = Engine(sched, {r.request_id: r for r, _, _ in reqs})
    finals = Counter()
    now = 0.0
    results = []
    eos_at = rnd.randrange(1, 40)
    for _ in range(5000):
        while pending and pending[0][0].arrival <= now:
            r, fate, ft = pending.popleft()
            try:
                sched.add(r)
                fates[r.request_id] = (fate, ft)
            except ValueError:
                assert sched.block_manager.blocks_for(r.max_total_tokens) > sched.block_manager.num_blocks
                finals[r.request_id] += 1
        events = []
        for rid, (fate, ft) in list(fates.items()):
            if fate in ("abort", "abort2") and ft <= now:
                events += sched.abort(rid)
                fates[rid] = ("abort", ft + 0.01) if fate == "abort2" else ("none", 0)
        out = sched.step(now, results)   # results in plan order, as a pipeline returns them
        for e in events + out.events:
            assert not finals[e.request_id], f"{e.request_id}: an event after its final ({e})"
            if e.finish_reason is not None:
                finals[e.request_id] += 1
        for plan in out.plans:
            seqs = plan.seqs
            assert len(seqs) <= max_bs, (len(seqs), max_bs)
            if budget and name != "request" and plan.iteration > 0:
                ntok = sum(len(s.token_ids) for s in seqs)
                prompt_toks = sum(len(s.token_ids) for s in seqs if s.start_pos < len(byid[s.request_id].prompt_token_ids))
                drafts = sum(s.draft for s in seqs)
                if ntok > budget:
                    assert prompt_toks == 0 and drafts == 0, f"plan {plan.iteration}: {ntok} tokens > budget {budget} (prompt {prompt_toks}, drafts {drafts})"
            ids = [s.request_id for s in seqs]
            assert len(set(ids)) == len(ids), f"duplicate rows {ids}"
            for s in seqs:
                if plan.iteration <= 0:
                    break
                table = s.block_table if hasattr(s, "block_table") else None
                if table is not None:
                    assert len(table) * bs >= s.seq_len, (s.request_id, len(table), s.seq_len)
            if plan.iteration > 0:
                engine.queued[plan.iteration] = plan
                for x in seqs:
                    if sched.pool.get(x.request_id) is None or sched.pool[x.request_id].phase.value == "finished":
                        engine.inactive.add(x.request_id)
            if plan.iteration > 0 and rnd.random() < 0.5:
                engine.swaps(plan)
            in_flight.append(plan)
        if sched.profiled:
            check_kv(sched)
        results = []
        if in_flight:
            plan = in_flight.popleft()
            now += 0.01 + 0.0002 * plan.num_tokens
            seqs = plan.seqs
            if plan.iteration <= 0:
                # probe: let the scheduler's profiler handle
                results = [IterationResult(plan.iteration, [-1] * len(seqs))]
                continue
            ids = [s.request_id for s in seqs]
            engine.swaps(plan)
            toks = []
            appended = {}
            for row, s in enumerate(seqs):
                engine.compute(s)
                n_tok = s.seq_len - s.draft
                if not s.sample:
                    toks.append(-1)
                    continue
                if s.draft:
                    kept = rnd.randrange(s.draft + 1)
                    app = list(s.token_ids[len(s.token_ids) - s.draft:][:kept])
                else:
                    app = []
                app.append(2 if n_tok + len(app) + 1 >= eos_at else rnd.randrange(3, 9))
                appended[row] = app
                toks.append(app[0])
                engine.sampled(s.request_id, s, app)
            failed = [rid for rid in ids if fates.get(rid, ("none", 0))[0] == "fail" and fates[rid][1] <= now]
            for rid in failed:
                fates[rid] = ("none", 0)
            result = IterationResult(plan.iteration, toks, failed=failed)
            pool_rows = [row for row, s in enumerate(seqs) if s.pool]
            if pool_rows:
                result.pool_rows = pool_rows
                result.pooled = np.ones((len(pool_rows), INFO.hidden_size), np.float32).tobytes()
            for row, s in enumerate(seqs):
                if s.draft:
                    result.verify_rows.append(row)
                    result.verified.append(appended[row][1:])
            results = [result]
        elif pending:
            now = max(now, pending[0][0].arrival)
        elif not sched.has_work():
            break
        else:
            raise AssertionError(f"stalled with work left: {sched.stats()} pool={[(r.request_id, r.phase, r.reserved_blocks, r.n_prompt_fed, len(r.prompt_token_ids), r.in_flight) for r in sched.pool.values()]}")
    else:
        raise AssertionError("did not finish")
    for r, _, _ in reqs:
        if r.grammar is not None:
            assert r.grammar.released == 1 or r.request_id not in sched.finished, (r.request_id, r.grammar.released)
    want = Counter({r.request_id: 1 for r, _, _ in reqs})
    assert finals == want, f"finals {dict(finals - want)} missing {dict(want - finals)}"
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.n_rsrv == 0 and not bm.device.tables and not bm.host.tables, bm.stats()
    assert bm.num_free_host_blocks == bm.num_host_blocks
    assert not sched.pool and not sched.in_flight


@pytest.mark.parametrize("block", range(4))
def test_random_workloads_keep_kv_exact_and_end_once(block):
    n = int(os.environ.get("ORCA_FUZZ_SEEDS", 60))
    for seed in range(block * n // 4, (block + 1) * n // 4):
        try:
            run(seed)
        except Exception as e:
            raise AssertionError(f"seed {seed}: {e}") from e


def test_request_level_embedding_rerun_keeps_its_window():
    """The request-level baseline reruns a finished embedding's last prompt position until its batch ends:
    the keys that row reads (its window) stay, or it computes that position's K/V over a hole and writes it
    into its last block, which the prefix cache published: a later prompt sharing it reads that K/V."""
    overrides = {"scheduler.policy": "request", "scheduler.max_bs": 2, "engine.block_size": 1, "engine.n_slots": 256,
                 "engine.prefix_caching": True, "speculative.method": "off"}
    sched = make_scheduler(load_config(overrides=overrides), SLIDING)
    embed = [3, 4, 5, 6, 7, 8, 3, 4]
    reqs = {"e": Request("e", embed, SamplingParams(max_tokens=1), pooling=PoolingParams("last")),
            "g": Request("g", [5, 5, 5], SamplingParams(max_tokens=12, ignore_eos=True)),
            "x": Request("x", embed + [6], SamplingParams(max_tokens=2, ignore_eos=True))}
    engine = Engine(sched, reqs)
    sched.add(reqs["e"])
    sched.add(reqs["g"])
    results, added = [], False
    for _ in range(100):
        if not added and "e" not in sched.pool and "g" not in sched.pool:
            sched.add(reqs["x"])   # its prompt's first 8 positions are e's, cached
            added = True
        out = sched.step(0.0, results)
        results = []
        for plan in out.plans:
            for s in plan.seqs:
                engine.compute(s)   # raises where a row reads K/V of another prefix
            toks = [7 if s.sample else -1 for s in plan.seqs]
            for s, t in zip(plan.seqs, toks):
                if s.sample:
                    engine.sampled(s.request_id, s, [t])
            result = IterationResult(plan.iteration, toks)
            if pool_rows := [row for row, s in enumerate(plan.seqs) if s.pool]:
                result.pool_rows = pool_rows
                result.pooled = np.ones((len(pool_rows), INFO.hidden_size), np.float32).tobytes()
            results.append(result)
        if added and not sched.has_work():
            break
    assert reqs["x"].cached_tokens == 8 and len(reqs["x"].output_token_ids) == 2
    assert not sched.pool and sched.block_manager.n_rsrv == 0


if __name__ == "__main__":
    lo, hi = int(sys.argv[1]), int(sys.argv[2])
    for seed in range(lo, hi):
        try:
            run(seed)
        except Exception as e:
            print(seed, f"{type(e).__name__}: {str(e)[:200]}")
            if len(sys.argv) > 3:
                traceback.print_exc()
