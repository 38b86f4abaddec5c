"""The sections of tools/gpu_check.py, each run in a process of its own (a CUDA error, a hang or a
crash loses that section only): `python -m orca_mq.bench.gpu_sections NAME --work DIR [--small]`.
Each prints one JSON line per result on stdout; a line with a `figure` is a row of the final table.
Sizes are the GPU's unless --small (tiny, for a CPU plumbing run)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orca_mq.bench.gpu_carry import FOLDER, ROOT
from orca_mq.bench.gpu_context import CLEANUP, Ctx, one_line, random_prompts
from orca_mq.bench.gpu_attention import decode, splitkv, tune
from orca_mq.bench.gpu_moe import moe
from orca_mq.bench.gpu_scale import fp8, kvsize
from orca_mq.bench.gpu_shapes import shape_burst, shape_iteration
from orca_mq.bench.gpu_speed import iteration, offline, served
from orca_mq.bench.shapes import ShapeRun, add_shape_args


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
    eager = "off"   # the reference comparisons run eagerly: no graph capture to wait for
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
    models, env, kernels, refusal, exactness, iteration, offline, served, determinism, fastserve, decode, tune, splitkv, kvsize,
    fp8, moe)}

SECTIONS |= {f.__name__: f for f in (shape_iteration, shape_burst)}   # --shape NAME's (orca_mq/bench/gpu_shapes.py)


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
    add_shape_args(ap)
    args = ap.parse_args()
    ctx = Ctx(args.section, args.work, args.small, ShapeRun.from_args(args))
    try:
        SECTIONS[args.section](ctx)
    except Exception as e:   # noqa: BLE001 - one line for the table, the traceback in the JSON
        ctx.emit("section failed", shown=one_line(e)[:160], met=False, error=one_line(e),
                 traceback=traceback.format_exc()[-3000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
