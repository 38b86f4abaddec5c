"""The speed sections of tools/gpu_check.py: iteration times beside a CUDA-graph probe of the same shape
and the kernels they launch, an offline burst, a served burst and the same trace offline."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from orca_mq.bench.gpu_carry import ROOT
from orca_mq.bench.gpu_context import CLEANUP, Ctx, random_prompts

GRAPH_MODES = ("on", "off")   # engine.cuda_graphs: the runner as served, and eager for the before


def iteration(ctx: Ctx) -> None:
    from orca_mq.bench.graph_probe import ProbeModel, pool_caches, probe
    from orca_mq.bench.plans import plan_for
    from orca_mq.protocol.iteration import pack

    sz, dtype = ctx.sizes, ctx.fast_dtype
    runners = {}
    for mode in GRAPH_MODES:
        with ctx.attempt(f"graphs {mode} runner", on_cpu_unavailable=mode == "on"):
            runners[mode] = ctx.runner("smol", dtype, engine__n_slots=sz.iter_slots, engine__cuda_graphs=mode,
                                       scheduler__max_bs=max(*sz.decode_batches, sz.mixed[1] + 1),
                                       scheduler__max_num_batched_tokens=max(sz.prefills))
    if not runners:
        raise RuntimeError("no engine runner could be built")
    if (on := runners.get("on")) is not None:
        g = on.graphs
        ctx.emit("cuda graphs captured (buckets, MiB, s)", len(g.graphs) if g else 0, target=">= 1" if ctx.cuda else None,
                 met=bool(g and g.graphs) if ctx.cuda else None,
                 shown=f"{len(g.graphs)} of {len(g.all)} ({len(g.sizes)} decode up to {g.sizes[-1]}, {len(g.token_sizes)} "
                       f"mixed up to {max(g.token_sizes, default=0)} tokens), {g.memory / 2**20:.0f} MiB, {g.capture_s:.1f} s"
                 if g else f"none: {on.graph_error or 'not on this device'}", how="ModelRunner.graphs after start")
    first = next(iter(runners.values()))
    yard = ProbeModel(first.info, first.model.w, first.model.mlps)   # its weights and its pool's memory
    how = (f"ModelRunner.execute of a packed plan (as a worker receives it: inputs staged, forward, sampling, "
           f"tokens back), median of {sz.repeat}, {dtype}, synchronized")
    for b in sz.decode_batches:
        plan = pack(plan_for([(1, sz.ctx - 1)] * b, first.block_size))
        ms = {}
        for mode, r in runners.items():
            with ctx.attempt(f"decode b={b} graphs {mode}"):
                ms[mode] = ctx.timed_ms(lambda r=r: r.execute(plan))
        p = probe(yard, b, sz.ctx, pool_caches(first.kv, b, sz.ctx), repeat=2 * sz.repeat)
        best = ms.get("on")
        base = p.get("graph_ms", p["eager_ms"])
        engine = " / ".join(f"{m} {v:.2f}" for m, v in ms.items())
        ratio = best / base if best else None
        ctx.emit(f"decode b={b} ctx={sz.ctx}: engine / probe {'graph' if 'graph_ms' in p else 'eager (no CUDA)'}",
                 ratio, unit="x", shown=(f"{ratio:.2f}x " if ratio else "") + f"({engine} ms; probe {base:.2f})",
                 target="<= 1.3x" if ctx.cuda else None, met=ratio <= 1.3 if ctx.cuda and ratio else None,
                 how=how + "; probe: orca_mq.bench.graph_probe (plain torch, same shape)", engine_ms=ms, probe=p)
    r = runners.get("on", next(iter(runners.values())))
    cases = [(f"prefill {q}", [(q, 0)]) for q in sz.prefills]
    cases.append((f"mixed {sz.mixed[0]}-token chunk + {sz.mixed[1]} decodes", [(sz.mixed[0], 0)] + [(1, sz.ctx - 1)] * sz.mixed[1]))
    for name, reqs in cases:
        with ctx.attempt(name):
            plan = pack(plan_for(reqs, r.block_size))
            ctx.emit(f"{name}: iteration ms", ctx.timed_ms(lambda: r.execute(plan)), unit="ms", how=how)
    for mode, r in runners.items():
        with ctx.attempt(f"launches graphs {mode}"):
            launches(ctx, r, mode, plan_for([(1, sz.ctx - 1)] * sz.launches_batch, r.block_size))


def launches(ctx: Ctx, runner: Any, mode: str, plan: Any) -> None:
    """CUDA kernels (and host launch calls) of one decode iteration, per layer, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    runner.execute(plan)
    ctx.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=acts) as prof:
        runner.execute(plan)
        ctx.sync()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    calls = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                             "cudaLaunchKernelExC", "cudaGraphLaunch")]
    n = runner.info.n_layers
    batch = len(plan.seqs)
    if not ctx.cuda:
        ctx.emit(f"kernel launches per layer, decode b={batch}, graphs {mode}", shown="no CUDA: not measured",
                 aten_ops_per_layer=sum(e.name.startswith("aten::") for e in events) / n)
        return
    ctx.emit(f"kernel launches per layer, decode b={batch}, graphs {mode}", len(kernels) / n,
             shown=f"{len(kernels) / n:.1f} ({len(kernels)} kernels, {len(calls)} host launch calls, {n} layers)",
             how="torch.profiler: CUDA kernels of one ModelRunner.execute / layers", kernels=len(kernels),
             host_launch_calls=len(calls), memcpy_memset=sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events) - len(kernels))


def offline(ctx: Ctx) -> None:
    from orca_mq import SamplingParams

    n, lo, hi, mt = ctx.sizes.offline
    prompts = random_prompts(random.Random(7), n, lo, hi)
    llm = ctx.llm("smol", dtype=ctx.fast_dtype, max_bs=ctx.sizes.offline_bs, n_slots=ctx.sizes.offline_slots,
                  max_num_batched_tokens=ctx.sizes.offline_budget)
    gen, s = burst(ctx, llm, prompts, [SamplingParams(max_tokens=mt, temperature=0, ignore_eos=True)] * n)
    ctx.emit(f"offline LLM.generate: {n} prompts of {lo}-{hi}, {mt} generated each: gen tok/s", gen / s, unit="tok/s",
             target=">= 50k" if ctx.cuda else None, met=gen / s >= 50_000 if ctx.cuda else None,
             how=f"orca_mq.LLM, {ctx.fast_dtype}, max_bs {ctx.sizes.offline_bs}, budget {ctx.sizes.offline_budget}, "
                 f"n_slots {ctx.sizes.offline_slots}, greedy, after a warm-up burst",
             prompt_tokens=sum(map(len, prompts)), gen_tokens=gen, s=s)


def burst(ctx: Ctx, llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[int, float]:
    """Generated tokens and seconds of one LLM.generate, after an untimed warm-up burst (Triton compiles,
    CUDA graphs, allocator growth) of a quarter as many prompts of the same lengths at 8 tokens, other
    tokens: the timed prompts must not find their prefixes cached."""
    from orca_mq import SamplingParams

    warm = random_prompts(random.Random(99), max(1, len(prompts) // 4), 1, 1, min(40000, llm.runner.info.vocab_size))
    warm = [w * len(p) for w, p in zip(warm, prompts)]
    llm.generate(warm, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * len(warm))
    ctx.sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    ctx.sync()
    s = time.perf_counter() - t
    if bad := [o.finish_reason for o in outs if o.finish_reason != "length"]:
        raise RuntimeError(f"{len(bad)} requests did not run to max_tokens: {sorted(set(bad))}")
    return sum(len(o.token_ids) for o in outs), s


@dataclass(frozen=True, slots=True)
class Burst:
    """A served burst of the orca trace (every request at once, through a launched server and
    tools/bench.py) and the same requests offline, on one model's checkpoint, with its targets (gen tok/s)."""

    n: int
    warm_n: int                       # the untimed served burst before it (0: none)
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    max_bs: int
    budget: int
    slots: int                        # engine.n_slots of the server (0: sized from the card); offline gets its pool
    sets: dict[str, Any] = field(default_factory=dict)   # more config keys, for the server and offline alike
    served_target: float | None = None
    offline_target: float | None = None
    ratio_target: float | None = None


def served(ctx: Ctx) -> None:
    sz = ctx.sizes
    served_and_offline(ctx, "smol", Burst(sz.served_n, sz.served_warm_n, sz.served_in, sz.served_out, sz.served_bs,
                                          sz.served_budget, sz.served_slots, served_target=30_000, ratio_target=0.8))


def served_and_offline(ctx: Ctx, name: str, b: Burst) -> None:
    """The served burst's gen tok/s and errors, the same trace's offline, and their ratio."""
    from orca_mq import SamplingParams
    from orca_mq.bench.trace import TraceSpec, load_corpus, make_trace
    from orca_mq.server.process import free_port, spawn
    from orca_mq.tokenizer import load_tokenizer

    model = str(ctx.models / name)
    budget = f"scheduler.max_num_batched_tokens={b.budget}"
    # the bench's clients in 4 processes: one Python client spends ~60 us a token, a ceiling near 16k tok/s
    procs = "1" if ctx.small else "4"
    common = ["--policy", "orca", "--trace", "orca", "--rate", "0", "--client-procs", procs, "--input-len", "%d:%d" % b.input_len,
              "--output-len", "%d:%d" % b.output_len, "--max-bs", str(b.max_bs), "--set", f"model.path={model}",
              "--set", budget, "--no-progress"]
    sets = {"model.path": model, "engine.device": ctx.device, "model.dtype": ctx.fast_dtype, "scheduler.max_bs": b.max_bs,
            "scheduler.max_num_batched_tokens": b.budget, "engine.n_slots": b.slots, **b.sets,
            "server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "server.http_address": "",
            "log.dir": ctx.work / f"{ctx.section}_logs"}
    t = time.perf_counter()
    server = spawn(sets, ctx.work / f"{ctx.section}.launch.log", ready_timeout=240)
    CLEANUP.append(lambda: os.killpg(server.proc.pid, signal.SIGKILL))
    ctx.emit(detail="server ready", s=time.perf_counter() - t, sets=sets)
    from orca_mq.client import Client

    try:
        runs = {}
        for what, n, seed in (("warm-up", b.warm_n, 12), ("measured", b.n, 11))[not b.warm_n:]:
            with Client(server.address) as c:
                c.stats(reset=True)
            out = ctx.work / f"{ctx.section}_{seed}.json"
            cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--address", server.address, "--num-requests", str(n),
                   "--seed", str(seed), "--out", str(out), *common]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
            (ctx.work / f"{ctx.section}_{seed}.log").write_text(run.stdout + run.stderr)
            if not out.exists():
                raise RuntimeError(f"bench ({what}) exit {run.returncode}: {run.stderr.strip()[-300:]}")
            runs[what] = json.loads(out.read_text())["summary"]
            ctx.emit(detail=f"served {what} burst", **{k: runs[what].get(k) for k in (
                "n_ok", "n_errors", "makespan_s", "throughput_tok_s", "total_prompt_tokens", "total_generated_tokens")})
        with Client(server.address) as c:
            st = c.stats()
        worker, sched = st["workers"][0], st["scheduler"]
        slots = sched["n_slots"]   # the pool as served (n_slots 0: sized from the card), offline too
        # where the served iteration loses time to the offline one: the round trip between iterations
        ctx.emit(detail="served measured burst: the round trip, median / p90 ms", **{
            k: (round(v["median_ms"], 3), round(v["p90_ms"], 3), round(v["sum_ms"], 1)) for k, v in (
                ("worker idle between iterations", worker["idle"]), ("worker compute", worker["compute"]),
                ("plan sent -> compute start", worker["plan_latency"]), ("result -> scheduler", sched["result_latency"]),
                ("scheduler turn", sched["turnaround"]))}, iterations=worker["iterations"])
    finally:
        server.stop(60)
    m = runs["measured"]
    conf = f"{ctx.fast_dtype}, max_bs {b.max_bs}, budget {b.budget}, n_slots {slots}"
    conf += "".join(f", {k} {v}" for k, v in b.sets.items())
    how = (f"tools/bench.py --address (server: orca-mq serve, {conf}) orca trace, {b.n} requests at once from "
           f"{procs} client processes" + f", after a {b.warm_n}-request warm-up burst" * bool(b.warm_n))
    tok_s = m["throughput_tok_s"]
    ctx.emit(f"served burst, orca trace, {b.n} requests: gen tok/s", tok_s, unit="tok/s", how=how,
             **_target(ctx, tok_s, b.served_target))
    ctx.emit("served burst: errors", m["n_errors"], target="0", met=m["n_errors"] == 0 and m["n_ok"] == b.n)
    # the same trace offline: the same requests (the bench's trace, seed 11), batch cap, budget and KV room
    tok = load_tokenizer(model)
    trace = make_trace(TraceSpec(kind="orca", num_requests=b.n, rate=0, input_len=b.input_len,
                                 output_len=b.output_len, seed=11), load_corpus(tok))
    if (p := sum(t.input_len for t in trace)) != m["total_prompt_tokens"]:
        raise RuntimeError(f"offline trace has {p} prompt tokens, the served one {m['total_prompt_tokens']}")
    llm = ctx.llm(name, dtype=ctx.fast_dtype, max_bs=b.max_bs, n_slots=slots, max_num_batched_tokens=b.budget, **b.sets)
    gen, s = burst(ctx, llm, [t.prompt_token_ids for t in trace],
                   [SamplingParams(max_tokens=t.max_tokens, temperature=0, ignore_eos=True) for t in trace])
    ctx.emit("the same trace offline (LLM.generate): gen tok/s", gen / s, unit="tok/s", **_target(ctx, gen / s, b.offline_target),
             how=f"orca_mq.LLM ({conf}), the same requests, after a warm-up burst", prompt_tokens=p, gen_tokens=gen, s=s)
    ratio = tok_s / (gen / s)
    ctx.emit("served / offline on the same trace", ratio, unit="x", **_target(ctx, ratio, b.ratio_target))


def _target(ctx: Ctx, value: float, target: float | None) -> dict[str, Any]:
    """A figure's target and whether it is met (a floor: value >= target), on a GPU only."""
    if target is None or not ctx.cuda:
        return {}
    return {"target": f">= {target / 1e3:g}k" if target >= 1000 else f">= {target:g}", "met": value >= target}
