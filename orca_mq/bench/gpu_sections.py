"""The sections of tools/gpu_check.py, each run in a process of its own (a CUDA error, a hang or a
crash loses that section only): `python -m orca_mq.bench.gpu_sections NAME --work DIR [--small]`.
Each prints one JSON line per result on stdout; a line with a `figure` is a row of the final table.
Sizes are the GPU's unless --small (tiny, for a CPU plumbing run)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orca_mq.bench.gpu_carry import FOLDER, ROOT
from orca_mq.config import Config

GRAPHS = "engine.cuda_graphs"       # auto | on | off, where the engine has it (issue 32)
# what a section started in sessions of their own (a server): stopped when the run kills it at its budget
CLEANUP: list[Callable[[], None]] = []


@dataclass(frozen=True)
class Sizes:
    exact_prefills: tuple[int, ...] = (1, 7, 33, 70, 300)
    exact_decodes: tuple[int, ...] = (2, 9, 16, 17, 100, 513)
    graph_decodes: int = 13                  # a batch between CUDA-graph buckets: padded rows in play
    decode_batches: tuple[int, ...] = (1, 32, 128, 256)
    ctx: int = 256
    prefills: tuple[int, ...] = (512, 2048)
    mixed: tuple[int, int] = (1792, 256)     # a prompt chunk + that many decodes
    launches_batch: int = 32
    repeat: int = 10
    iter_slots: int = 80_000
    offline: tuple[int, int, int, int] = (512, 64, 512, 128)   # requests, prompt min, max, generated each
    offline_budget: int = 8192
    offline_bs: int = 512
    offline_slots: int = 400_000
    served_n: int = 256
    served_warm_n: int = 64
    served_in: tuple[int, int] = (32, 512)
    served_out: tuple[int, int] = (1, 256)
    served_bs: int = 128
    served_budget: int = 2048
    served_slots: int = 131_072   # max_bs requests at the longest prompt + output
    det: tuple[int, int, int] = (8, 24, 24)  # targets, fillers, tokens
    det_len: tuple[int, int] = (300, 600)    # longest target, filler prompt
    fs_n: int = 96
    fs_len: tuple[int, int, int] = (32, 400, 96)   # prompt min, max, longest output
    fs_slots: tuple[int, int] = (65_536, 4096)     # orca (room for all), fastserve (too small)
    host_slots: int = 65_536


SMALL = Sizes(exact_prefills=(1, 7, 33), exact_decodes=(2, 9, 40), graph_decodes=3, decode_batches=(1, 4), ctx=32,
              prefills=(64,), mixed=(48, 4), launches_batch=4, repeat=3, iter_slots=2048, offline=(16, 16, 64, 8),
              offline_budget=256, offline_bs=16, offline_slots=4096, served_n=16, served_warm_n=4, served_in=(16, 64),
              served_out=(1, 16), served_bs=8, served_budget=256, served_slots=4096, det=(4, 8, 8), det_len=(40, 80),
              fs_n=8, fs_len=(16, 64, 32), fs_slots=(4096, 256), host_slots=8192)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:300]}"


def has_key(dotted: str) -> bool:
    section, key = dotted.split(".")
    return key in {f.name for f in dataclasses.fields(getattr(Config(), section))}


class Ctx:
    def __init__(self, section: str, work: Path, small: bool) -> None:
        self.section, self.work, self.small = section, work, small
        self.sizes = SMALL if small else Sizes()
        self.cuda = torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.fast_dtype = "bfloat16" if self.cuda else "float32"   # the speed sections' dtype (bf16 on the GPU)
        self.models = work / "models"

    def emit(self, figure: str | None = None, value: Any = None, *, unit: str = "", target: str | None = None,
             met: bool | None = None, shown: str | None = None, how: str = "", **detail: Any) -> None:
        row = {"section": self.section, **({"figure": figure} if figure else {}), "value": value, "unit": unit,
               "target": target, "met": met, "shown": shown, "how": how, **detail}
        print(json.dumps({k: v for k, v in row.items() if v is not None and v != ""}, default=str), flush=True)

    @contextlib.contextmanager
    def attempt(self, what: str, on_cpu_unavailable: bool = False) -> Iterator[None]:
        """A sub-check whose failure is a row, not the end of the section. `on_cpu_unavailable`: on the
        CPU a failure means the feature is CUDA-only (shown, not failed)."""
        try:
            yield
        except Exception as e:   # noqa: BLE001
            if on_cpu_unavailable and not self.cuda:
                self.emit(f"{what}: not on the CPU", shown=one_line(e)[:120])
            else:
                self.emit(f"{what}: error", shown=one_line(e)[:160], met=False, error=one_line(e),
                          traceback=traceback.format_exc()[-2500:])

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed_ms(self, fn: Callable[[], object], repeat: int | None = None) -> float:
        """Median ms of `fn` (with a CUDA synchronize) after two untimed calls (compiles, captures)."""
        from orca_mq.bench.timing import median_time

        fn()
        return median_time(lambda: (fn(), self.sync()), repeat or self.sizes.repeat) * 1e3

    def runner(self, model: str, dtype: str, **sets: Any) -> Any:
        from orca_mq.config import load_config
        from orca_mq.engine.model_runner import ModelRunner

        over = {"model.path": str(self.models / model), "engine.block_size": 16, "engine.device": self.device,
                "model.dtype": dtype, **{k.replace("__", "."): v for k, v in sets.items() if v is not None}}
        return ModelRunner(load_config(overrides=over))

    def llm(self, model: str, **kw: Any) -> Any:
        from orca_mq import LLM

        return LLM(model=str(self.models / model), device=self.device, **kw)

    def hf(self, model: str, dtype: torch.dtype) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.models / model, dtype=dtype).to(self.device).eval()


def graph_modes() -> list[str | None]:
    """Both engine.cuda_graphs settings where the engine has the knob; else the engine as it is."""
    return ["on", "off"] if has_key(GRAPHS) else [None]


def label(mode: str | None) -> str:
    return f"graphs {mode}" if mode else "engine (no engine.cuda_graphs)"


def random_prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---------------------------------------------------------------- sections

def models(ctx: Ctx) -> None:
    from orca_mq.bench.gpu_carry import model_source
    from orca_mq.bench.random_models import check_models

    done, kind = ctx.models / "done", "small" if ctx.small else "full"
    t = time.perf_counter()
    if done.exists() and done.read_text() == kind:   # a rerun on a warm machine keeps them
        ctx.emit("random-weight models (smol, smol_tie)", shown=f"reused ({ctx.models})")
        return
    check_models(model_source(FOLDER, ctx.work), ctx.models, ctx.small)
    done.write_text(kind)
    ctx.emit("random-weight models (smol, smol_tie): built in", time.perf_counter() - t, unit="s",
             how="orca_mq.bench.random_models.check_models: the embedded model's shape" + " (--small: 2 layers)" * ctx.small)


def env(ctx: Ctx) -> None:
    import os
    import platform

    import triton

    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        ctx.emit("device", shown=f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}",
                 value=torch.cuda.get_device_name(), how="torch.cuda")
        ctx.emit("GPU memory", props.total_memory / 2**30, unit="GiB", how="torch.cuda.get_device_properties")
        driver = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "?"
    else:
        ctx.emit("device", shown="cpu (no CUDA)", value="cpu", how="torch.cuda.is_available() is False")
        driver = "-"
    versions = f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, driver {driver}"
    ctx.emit("versions", shown=versions, value=versions)
    ctx.emit("host", shown=f"python {platform.python_version()}, {os.cpu_count()} cores", value=os.cpu_count())


def kernels(ctx: Ctx) -> None:
    out = ctx.work / "kernels.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_kernels.py"), "--out", str(out)]
    cmd += ["--dtype", "bfloat16", "--warmup", "10", "--rep", "30"] if ctx.cuda else ["--interpret"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    (ctx.work / "kernels.log").write_text(run.stdout + run.stderr)
    if not out.exists():
        raise RuntimeError(f"bench_kernels exit {run.returncode}: {(run.stderr or run.stdout).strip()[-300:]}")
    data = json.loads(out.read_text())
    rows, dtype = data["results"], data["meta"]["dtype"]
    for r in rows:
        ctx.emit(detail="kernel", **r)
    worst = max(r["rel_err"] for r in rows)
    tol = 1e-4 if dtype == "float32" else 2e-2   # bench_kernels' own tolerance
    ctx.emit(f"max rel err vs reference ({dtype}, {len(rows)} kernel x shape)", worst, target=f"<= {tol:g}",
             met=worst <= tol and run.returncode == 0, how=" ".join(cmd[1:]) + f" (exit {run.returncode})")
    att = [r for r in rows if r["kernel"] == "attention_vs_sdpa_loop"]
    if att and ctx.cuda:
        r = att[0]
        ctx.emit(f"attention {r['scenario']}: triton ms (SDPA loop ms)", r["triton_ms"], unit="ms",
                 shown=f"{r['triton_ms']:.3f} ({r['ref_ms']:.3f})", how="triton.testing.do_bench median")


def refusal(ctx: Ctx) -> None:
    from orca_mq.server.process import free_port

    gpus = torch.cuda.device_count() if ctx.cuda else 0
    stages = max(2, gpus + 1)   # the first GPU run: 2 stages on 1 GPU died inside NCCL
    cmd = [sys.executable, str(ROOT / "tools" / "launch.py"), "--port", str(free_port()), "--set", "engine.device=cuda",
           "--set", f"engine.n_workers={stages}", "--set", "server.http_address=", "--set", f"log.dir={ctx.work / 'refusal_logs'}"]
    if (ctx.models / "smol").exists():
        cmd += ["--set", f"model.path={ctx.models / 'smol'}"]
    t = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    s = time.perf_counter() - t
    lines = run.stderr.strip().splitlines()
    ok = run.returncode == 1 and len(lines) == 1 and "CUDA device" in run.stderr and READY not in run.stdout
    ctx.emit(f"{stages} pipeline stages on {gpus} GPU(s): refused at start, one line, exit 1", s, unit="s",
             shown=f"exit {run.returncode} in {s:.1f} s, {len(lines)} line(s)", target="exit 1, 1 line", met=ok,
             how="tools/launch.py --set engine.device=cuda --set engine.n_workers=N", stderr=run.stderr[-1500:])


READY = "orca-mq ready on"


def exactness(ctx: Ctx) -> None:
    from orca_mq.bench.plans import mixed_iteration_logits

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sz = ctx.sizes
    ref32 = ctx.hf("smol", torch.float32)
    vocab = ref32.config.vocab_size
    rng = random.Random(1234)
    prefills = [[rng.randrange(vocab) for _ in range(n)] for n in sz.exact_prefills]
    decodes = [[rng.randrange(vocab) for _ in range(n)] for n in sz.exact_decodes]

    @torch.no_grad()
    def reference(model: Any) -> torch.Tensor:
        return torch.stack([model(torch.tensor([s], device=ctx.device)).logits[0, -1] for s in prefills + decodes]).float()

    exp = reference(ref32)
    eager = "off" if has_key(GRAPHS) else None   # these iterations are mixed: no graph capture to wait for
    shape = f"{len(prefills)} prompts + {len(decodes)} decodes, up to {max(sz.exact_prefills + sz.exact_decodes)} tokens"
    for backend in ("triton", "torch") if ctx.cuda else ("cpu", "torch"):
        with ctx.attempt(f"fp32 {backend} attention"):
            r = ctx.runner("smol", "float32", engine__attention_backend=backend, engine__cuda_graphs=eager)
            ours = mixed_iteration_logits(r, prefills, decodes, random.Random(1)).float()
            err = (ours - exp).abs().max().item()
            top1 = (ours.argmax(-1) == exp.argmax(-1)).float().mean().item()
            ctx.emit(f"fp32 logits vs transformers, {backend} attention: max abs", err, target="<= 1e-4", met=err <= 1e-4,
                     shown=f"{err:.2g} (top-1 agrees {top1:.0%})",
                     how=f"one mixed iteration ({shape}) vs transformers fp32 on {ctx.device}", top1_agree=top1,
                     logit_scale=exp.abs().max().item())
            del r
    with ctx.attempt("bf16 vs transformers"):
        r = ctx.runner("smol", "bfloat16", engine__cuda_graphs=eager)
        ours = mixed_iteration_logits(r, prefills, decodes, random.Random(1)).float()
        del r
        theirs = reference(ctx.hf("smol", torch.bfloat16))
        err, own = (ours - exp).abs().max().item(), (theirs - exp).abs().max().item()
        ctx.emit("bf16 logits: max abs vs transformers fp32", err, target=f"<= 1.5x HF bf16 ({own:.3g})",
                 met=err <= 1.5 * own, how=f"the same iteration in bf16; transformers' own bf16 is {own:.3g} from its fp32",
                 transformers_bf16=own)
    del ref32
    if not has_key(GRAPHS):
        ctx.emit("decode logits, cuda_graphs on vs off", shown="n/a: the engine has no engine.cuda_graphs yet")
        return
    n = sz.graph_decodes
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(2, sz.ctx))] for _ in range(n)]
    chunks = prefills[:3]   # a mixed iteration of prompts and decodes: the mixed graphs' token buckets
    got: dict[str, dict[str, torch.Tensor]] = {}
    for mode in ("on", "off"):
        with ctx.attempt(f"cuda_graphs={mode} iterations", on_cpu_unavailable=mode == "on"):
            r = ctx.runner("smol", "float32", engine__cuda_graphs=mode, scheduler__max_bs=max(n, 16),
                           scheduler__max_num_batched_tokens=2048)
            got[mode] = {"decode": mixed_iteration_logits(r, [], seqs, random.Random(2)).float(),
                         "mixed": mixed_iteration_logits(r, chunks, seqs, random.Random(3)).float()}
            del r
    if len(got) == 2:
        for kind, what in (("decode", f"batch {n}"), ("mixed", f"{len(chunks)} prompts + {n} decodes")):
            diff = (got["on"][kind] - got["off"][kind]).abs().max().item()
            ctx.emit(f"{kind} logits, cuda_graphs on vs off (fp32, {what}): max abs", diff, target="<= 1e-4",
                     met=diff <= 1e-4, how="the same iteration after the same prefills, two runners (budget 2048)",
                     bit_identical=bool(torch.equal(got["on"][kind], got["off"][kind])))


def iteration(ctx: Ctx) -> None:
    from orca_mq.bench.graph_probe import ProbeModel, probe
    from orca_mq.bench.plans import plan_for
    from orca_mq.protocol.iteration import pack

    sz, dtype = ctx.sizes, ctx.fast_dtype
    runners = {}
    for mode in graph_modes():
        with ctx.attempt(f"{label(mode)} runner", on_cpu_unavailable=mode == "on"):
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
    info = next(iter(runners.values())).info
    yard = ProbeModel(info, torch.device(ctx.device), getattr(torch, dtype))
    how = (f"ModelRunner.execute of a packed plan (as a worker receives it: inputs staged, forward, sampling, "
           f"tokens back), median of {sz.repeat}, {dtype}, synchronized")
    for b in sz.decode_batches:
        plan = pack(plan_for([(1, sz.ctx - 1)] * b, next(iter(runners.values())).block_size))
        ms = {}
        for mode, r in runners.items():
            with ctx.attempt(f"decode b={b} {label(mode)}"):
                ms[mode] = ctx.timed_ms(lambda r=r: r.execute(plan))
        p = probe(yard, b, sz.ctx, repeat=2 * sz.repeat)
        best = ms.get("on", ms.get(None))
        base = p.get("graph_ms", p["eager_ms"])
        engine = " / ".join(f"{m or 'engine'} {v:.2f}" for m, v in ms.items())
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
        with ctx.attempt(f"launches {label(mode)}"):
            launches(ctx, r, mode, plan_for([(1, sz.ctx - 1)] * sz.launches_batch, r.block_size))


def launches(ctx: Ctx, runner: Any, mode: str | None, plan: Any) -> None:
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
        ctx.emit(f"kernel launches per layer, decode b={batch}, {label(mode)}", shown="no CUDA: not measured",
                 aten_ops_per_layer=sum(e.name.startswith("aten::") for e in events) / n)
        return
    ctx.emit(f"kernel launches per layer, decode b={batch}, {label(mode)}", len(kernels) / n,
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

    warm = random_prompts(random.Random(99), max(1, len(prompts) // 4), 1, 1)
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


def served(ctx: Ctx) -> None:
    from orca_mq import SamplingParams
    from orca_mq.bench.trace import TraceSpec, load_corpus, make_trace
    from orca_mq.server.process import free_port, spawn
    from orca_mq.tokenizer import load_tokenizer

    sz, model = ctx.sizes, str(ctx.models / "smol")
    budget = f"scheduler.max_num_batched_tokens={sz.served_budget}"
    # the bench's clients in 4 processes: one Python client spends ~60 us a token, a ceiling near 16k tok/s
    procs = "1" if ctx.small else "4"
    common = ["--policy", "orca", "--trace", "orca", "--rate", "0", "--client-procs", procs, "--input-len", "%d:%d" % sz.served_in,
              "--output-len", "%d:%d" % sz.served_out, "--max-bs", str(sz.served_bs), "--set", f"model.path={model}",
              "--set", budget, "--no-progress"]
    sets = {"model.path": model, "engine.device": ctx.device, "model.dtype": ctx.fast_dtype, "scheduler.max_bs": sz.served_bs,
            "scheduler.max_num_batched_tokens": sz.served_budget, "engine.n_slots": sz.served_slots,
            "server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "server.http_address": "",
            "log.dir": ctx.work / "served_logs"}
    t = time.perf_counter()
    server = spawn(sets, ctx.work / "served.launch.log", ready_timeout=240)
    CLEANUP.append(lambda: os.killpg(server.proc.pid, signal.SIGKILL))
    ctx.emit(detail="server ready", s=time.perf_counter() - t, sets=sets)
    try:
        runs = {}
        for name, n, seed in (("warm-up", sz.served_warm_n, 12), ("measured", sz.served_n, 11)):
            out = ctx.work / f"served_{seed}.json"
            cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--address", server.address, "--num-requests", str(n),
                   "--seed", str(seed), "--out", str(out), *common]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
            (ctx.work / f"served_{seed}.log").write_text(run.stdout + run.stderr)
            if not out.exists():
                raise RuntimeError(f"bench ({name}) exit {run.returncode}: {run.stderr.strip()[-300:]}")
            runs[name] = json.loads(out.read_text())["summary"]
            ctx.emit(detail=f"served {name} burst", **{k: runs[name].get(k) for k in (
                "n_ok", "n_errors", "makespan_s", "throughput_tok_s", "total_prompt_tokens", "total_generated_tokens")})
    finally:
        server.stop(60)
    m = runs["measured"]
    how = (f"tools/bench.py --address (server: tools/launch.py, {ctx.fast_dtype}, max_bs {sz.served_bs}, budget "
           f"{sz.served_budget}, n_slots {sz.served_slots}) orca trace, {sz.served_n} requests at once from "
           f"{procs} client processes, after a {sz.served_warm_n}-request warm-up burst")
    ctx.emit(f"served burst, orca trace, {sz.served_n} requests: gen tok/s", m["throughput_tok_s"], unit="tok/s",
             target=">= 30k" if ctx.cuda else None, met=m["throughput_tok_s"] >= 30_000 if ctx.cuda else None, how=how)
    ctx.emit("served burst: errors", m["n_errors"], target="0", met=m["n_errors"] == 0 and m["n_ok"] == sz.served_n)
    # the same trace offline: the same requests (the bench's trace, seed 11), batch cap, budget and KV room
    tok = load_tokenizer(model)
    trace = make_trace(TraceSpec(kind="orca", num_requests=sz.served_n, rate=0, input_len=sz.served_in,
                                 output_len=sz.served_out, seed=11), load_corpus(tok))
    if (p := sum(t.input_len for t in trace)) != m["total_prompt_tokens"]:
        raise RuntimeError(f"offline trace has {p} prompt tokens, the served one {m['total_prompt_tokens']}")
    llm = ctx.llm("smol", dtype=ctx.fast_dtype, max_bs=sz.served_bs, n_slots=sz.served_slots,
                  max_num_batched_tokens=sz.served_budget)
    gen, s = burst(ctx, llm, [t.prompt_token_ids for t in trace],
                   [SamplingParams(max_tokens=t.max_tokens, temperature=0, ignore_eos=True) for t in trace])
    ctx.emit("the same trace offline (LLM.generate): gen tok/s", gen / s, unit="tok/s",
             how="orca_mq.LLM, the same requests, max_bs, budget and n_slots, after a warm-up burst")
    ratio = m["throughput_tok_s"] / (gen / s)
    ctx.emit("served / offline on the same trace", ratio, unit="x", target=">= 0.8", met=ratio >= 0.8 if ctx.cuda else None)


def determinism(ctx: Ctx) -> None:
    """Near-tied LM head: greedy tokens alone vs inside a busy batch, default and deterministic mode."""
    from orca_mq import SamplingParams

    n_targets, n_fillers, tokens = ctx.sizes.det
    rng = random.Random(3)
    targets = random_prompts(rng, n_targets, 8, ctx.sizes.det_len[0])
    fillers = random_prompts(rng, n_fillers, 8, ctx.sizes.det_len[1])
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    half = n_fillers // 2
    for det in (False, True):
        with ctx.attempt(f"deterministic={det}"):
            llm = ctx.llm("smol_tie", dtype="float32", max_bs=32, n_slots=65536 if ctx.cuda else 8192,
                          deterministic=det, max_num_batched_tokens=256)
            alone = [llm.generate([p], sp)[0].token_ids for p in targets]
            mixed = llm.generate(fillers[:half] + targets + fillers[half:], sp)[half:half + n_targets]
            diff = sum(a != m.token_ids for a, m in zip(alone, mixed))
            mode = "engine.deterministic" if det else "default mode"
            ctx.emit(f"{mode}: targets whose tokens change inside {n_fillers} fillers", diff,
                     shown=f"{diff}/{n_targets} ({llm.runner.model.attention_backend} attention)",
                     target="0" if det else "> 0 (probe sensitive)", met=diff == 0 if det else diff > 0,
                     how=f"near-tied LM head (smol_tie), fp32, greedy, {tokens} tokens, budget 256, max_bs 32")
            del llm


def fastserve(ctx: Ctx) -> None:
    """FastServe with a KV pool too small for the burst (offload/upload on the copy path) vs ORCA with
    room for all, both deterministic: every request's tokens must be identical."""
    from orca_mq import SamplingParams

    sz = ctx.sizes
    rng = random.Random(5)
    lo, hi, longest = sz.fs_len
    prompts = random_prompts(rng, sz.fs_n, lo, hi)
    sps = [SamplingParams(max_tokens=rng.randint(1, longest), temperature=0, ignore_eos=True) for _ in prompts]
    res, moved = {}, {"out": 0, "in": 0}
    for policy, slots in zip(("orca", "fastserve"), sz.fs_slots):
        # preempt_margin 0 (the paper's rule): a new job always takes an idle job's room, so its KV is
        # offloaded and uploaded again (the default margin may preempt nothing in a short burst)
        llm = ctx.llm("smol", dtype="float32", max_bs=64, n_slots=slots, host_slots=sz.host_slots, policy=policy,
                      deterministic=True, preempt_margin=0.0)
        if policy == "fastserve":   # count the blocks its plans move: identical tokens prove nothing without them
            launch = llm.runner.launch

            def counted(plan: Any, *a: Any) -> Any:
                moved["out"] += len(plan.swap_out)
                moved["in"] += len(plan.swap_in)
                return launch(plan, *a)

            llm.runner.launch = counted
        res[policy] = [o.token_ids for o in llm.generate(prompts, sps)]
        del llm
    same = sum(a == b for a, b in zip(res["orca"], res["fastserve"]))
    ctx.emit(f"FastServe (n_slots {sz.fs_slots[1]}) vs ORCA (n_slots {sz.fs_slots[0]}): identical requests", same,
             shown=f"{same}/{sz.fs_n}, {moved['out']} blocks offloaded, {moved['in']} uploaded", target=f"{sz.fs_n}/{sz.fs_n}",
             met=same == sz.fs_n and moved["out"] > 0 and moved["in"] > 0, moved=moved,
             how="orca_mq.LLM, fp32, engine.deterministic, fastserve.preempt_margin=0, greedy; blocks counted from the plans")


SECTIONS: dict[str, Callable[[Ctx], None]] = {f.__name__: f for f in (
    models, env, kernels, refusal, exactness, iteration, offline, served, determinism, fastserve)}


def _on_sigterm(signum: int, _frame: object) -> None:
    for fn in CLEANUP:
        with contextlib.suppress(OSError):
            fn()
    os._exit(128 + signum)


def main() -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("section", choices=SECTIONS)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    ctx = Ctx(args.section, args.work, args.small)
    try:
        SECTIONS[args.section](ctx)
    except Exception as e:   # noqa: BLE001 - one line for the table, the traceback in the JSON
        ctx.emit("section failed", shown=one_line(e)[:160], met=False, error=one_line(e),
                 traceback=traceback.format_exc()[-3000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
