"""tools/gpu_check.py's sections for the memory and FP8 of issue 42 (run by name, not in the default call):

- kvsize: the KV pool sized from the card (`engine.n_slots = 0`): each term, the pool and what its
  profile costs at start, at the default and at a large batch; the card's memory in use once an
  iteration at the token budget has run (at most engine.gpu_memory_utilization); and a served
  start, whose stats must say the same terms.
- fp8: FP8 against bf16 GEMMs at Llama 3 8B's shapes (activation scaling included), and on the
  random-weight model the logits and greedy tokens of model.quantization = fp8 against bf16,
  beside bf16's own against fp32 as the yardstick.
"""
from __future__ import annotations

import gc
import os
import random
import signal
import time

import torch

from orca_mq.bench.gpu_attention import kernel_ms
from orca_mq.bench.gpu_context import CLEANUP, Ctx, random_prompts

# Llama 3 8B: (in, out) of qkv, o, gate_up, down
GEMMS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
SMALL_GEMMS = {"qkv": (128, 192), "down": (256, 128)}
ROWS, SMALL_ROWS = (1, 16, 128, 1024, 4096), (1, 16)


def kvsize(ctx: Ctx) -> None:
    from orca_mq.engine.kv_budget import profile_plan, profile_rows

    for bs, budget in ((32, 256), (512, 8192)) if ctx.cuda else ((8, 256),):
        with ctx.attempt(f"sized pool, max_bs {bs}, budget {budget}"):
            t = time.perf_counter()
            r = ctx.runner("smol", ctx.fast_dtype, engine__n_slots=0, scheduler__max_bs=bs,
                           scheduler__max_num_batched_tokens=budget)
            start_s = time.perf_counter() - t
            s = r.kv_sizing
            if s is None:
                ctx.emit(f"KV pool, max_bs {bs}, budget {budget}", r.pool.device_slots, unit="slots",
                         shown=f"{r.pool.device_slots} slots as configured (no device memory to size it from)")
                continue
            r.execute(profile_plan(profile_rows(budget, bs, r.max_len), r.block_size))   # the profile's iteration again
            ctx.sync()
            free, total = torch.cuda.mem_get_info()
            used = 1 - free / total
            util = s.utilization
            ctx.emit(f"KV pool from the card, max_bs {bs}, budget {budget}: slots", s.agreed * s.block_size, unit="slots",
                     shown=f"{s.agreed * s.block_size} slots: {s.describe()}", terms=s.as_dict(), start_s=start_s,
                     how="ModelRunner with engine.n_slots = 0 (orca_mq/engine/kv_budget.py), smol, "
                         f"{ctx.fast_dtype}; start_s includes the profile and both graph captures")
            ctx.emit(f"card memory in use after an iteration at the budget (max_bs {bs})", used, unit="x",
                     target=f"<= {util:g} + 0.02", met=used <= util + 0.02,
                     shown=f"{used:.3f} of {total / 2**30:.1f} GiB", how="1 - torch.cuda.mem_get_info free / total")
            del r
            release()
    with ctx.attempt("served start, n_slots = 0", on_cpu_unavailable=True):
        served_terms(ctx)


def release() -> None:
    """The runner's pool back to the card before the next one is sized (or the server started): on the
    first device run `del` alone left it held (a reference cycle), and the second sizing counted the
    first pool as this process's weights and found 0 slots."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    if free < 0.5 * total:
        raise RuntimeError(f"the last runner's memory was not freed: {(total - free) / 2**30:.1f} GiB still in use")


def served_terms(ctx: Ctx) -> None:
    """A server started with n_slots = 0: the launcher's line and the stats' terms, the scheduler's pool."""
    from orca_mq.client import Client
    from orca_mq.server.process import free_port, spawn

    if not ctx.cuda:
        raise RuntimeError("no device memory to size the pool from on the CPU")
    sets = {"model.path": ctx.models / "smol", "engine.device": "cuda", "model.dtype": ctx.fast_dtype, "engine.n_slots": 0,
            "server.frontend_address": f"tcp://127.0.0.1:{free_port()}", "server.http_address": "",
            "log.dir": ctx.work / "kvsize_logs"}
    server = spawn(sets, ctx.work / "kvsize.launch.log", ready_timeout=180)
    CLEANUP.append(lambda: os.killpg(server.proc.pid, signal.SIGKILL))
    try:
        with Client(server.address) as c:
            out = c.generate("hello", max_tokens=8, temperature=0.0, ignore_eos=True)
            st = c.stats()
    finally:
        server.stop(60)
    pool = st["workers"][0].get("kv_pool", {})
    ok = bool(pool) and st["scheduler"]["n_slots"] == st["frontend"]["kv_slots"] == pool["slots"] and len(out.token_ids) == 8
    line = next((x for x in server.stderr().splitlines() if "KV pool from the device's memory" in x), "no line")
    ctx.emit("served: the stats' pool = the scheduler's = the frontend's", ok, target="True", met=ok,
             shown=f"{st['scheduler']['n_slots']} slots; {line[-150:]}", stats_pool=pool)


def fp8(ctx: Ctx) -> None:
    from orca_mq.engine import fp8 as f8

    gemms, rows = (GEMMS, ROWS) if ctx.cuda else (SMALL_GEMMS, SMALL_ROWS)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator().manual_seed(3)
    with ctx.attempt("fp8 GEMMs"):
        weights = {k: (torch.randn(o, i, generator=gen) * i ** -0.5).to(dtype).to(ctx.device) for k, (i, o) in gemms.items()}
        quantized = {k: f8.quantize_weight(w) for k, w in weights.items()}
        x = (torch.randn(64, 4096, generator=gen) * torch.logspace(-4, 4, 64)[:, None]).to(dtype).to(ctx.device)
        (q, sq), (qr, sr) = f8.quantize_activations(x), f8.quantize_rows(x)
        same = torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(sq, sr)
        ctx.emit("fp8 activation rows: bytes equal torch's quantize_rows", same, target="True" if ctx.cuda else None,
                 met=same if ctx.cuda else None, how="engine/fp8.py quantize_activations (kernels/fp8_quant_kernel.py on "
                 "CUDA) vs quantize_rows, 64 rows of 4096 over 8 decades")
        for m in rows:
            xs = {k: torch.randn(m, w.shape[1], generator=gen).to(dtype).to(ctx.device) for k, w in weights.items()}
            plain = sum(kernel_ms(ctx, lambda k=k: torch.nn.functional.linear(xs[k], weights[k])) for k in gemms)
            eight = sum(kernel_ms(ctx, lambda k=k: f8.linear(xs[k], quantized[k])) for k in gemms)  # type: ignore[arg-type]
            scaling = sum(kernel_ms(ctx, lambda k=k: f8.quantize_activations(xs[k])) for k in gemms)
            ctx.emit(f"fp8 / bf16 GEMM time, {m} rows, an 8B layer's 4 GEMMs", eight / plain, unit="x",
                     shown=f"{eight / plain:.2f}x ({eight:.3f} / {plain:.3f} ms; scaling {scaling:.3f} ms)", fp8_ms=eight,
                     bf16_ms=plain, scaling_ms=scaling,
                     how="engine/fp8.py linear (per-token scaling + torch._scaled_mm) vs F.linear, do_bench medians; "
                         "scaling: quantize_activations alone")
    with ctx.attempt("fp8 model accuracy", on_cpu_unavailable=True):
        accuracy(ctx)


def accuracy(ctx: Ctx) -> None:
    """fp8 vs bf16 and bf16 vs fp32 on the random-weight model: one mixed iteration's logits
    (teacher-forced: every position judged on the same inputs) and greedy generations."""
    from orca_mq import SamplingParams
    from orca_mq.bench.plans import mixed_iteration_logits

    rng = random.Random(11)
    prefills = random_prompts(rng, 6, 16, 300)
    decodes = random_prompts(rng, 24, 2, 400)
    logits = {}
    for name, dtype, quant in (("fp32", "float32", "none"), ("bf16", "bfloat16", "none"), ("fp8", "bfloat16", "fp8")):
        r = ctx.runner("smol", dtype, model__quantization=quant, engine__n_slots=65536, engine__cuda_graphs="off")
        logits[name] = mixed_iteration_logits(r, prefills, decodes, random.Random(1)).float()
        del r
    prompts = random_prompts(rng, 32, 16, 200)
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    tokens = {}
    for name, dtype, quant in (("fp32", "float32", "none"), ("bf16", "bfloat16", "none"), ("fp8", "bfloat16", "fp8")):
        llm = ctx.llm("smol", dtype=dtype, quantization=quant, n_slots=65536, max_bs=32)
        tokens[name] = [o.token_ids for o in llm.generate(prompts, sp)]
        del llm
    for a, b in (("fp8", "bf16"), ("bf16", "fp32")):
        la, lb = logits[a], logits[b]
        top1 = (la.argmax(-1) == lb.argmax(-1)).float().mean().item()
        rel = ((la - lb).norm(dim=-1) / lb.norm(dim=-1)).mean().item()
        prefix = [next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta)) / len(ta)
                  for ta, tb in zip(tokens[a], tokens[b])]
        same = sum(p == 1 for p in prefix)
        ctx.emit(f"{a} vs {b}, random model: greedy tokens agreeing (mean prefix)", sum(prefix) / len(prefix), unit="x",
                 shown=f"{sum(prefix) / len(prefix):.2f} ({same}/{len(prefix)} identical); logits: top-1 {top1:.1%}, "
                       f"rel L2 {rel:.3f}, max abs {(la - lb).abs().max().item():.3g}",
                 how="smol (random weights, the embedded model's shape): a mixed iteration of 6 prompts + 24 decodes; "
                     "32 prompts x 64 greedy tokens", top1=top1, rel_l2=rel, identical=same)
