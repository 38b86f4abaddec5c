"""The mixture of experts' speed paths (issue 40) against a per-token loop in float64 (each token's k
experts one at a time, summed in slot order: nothing grouped, sorted or padded):

* the CPU grouped path (models/layers/moe.py `grouped`: the extension's grouped_rows streaming an
  expert's few rows past its weight, float32 or bfloat16, and one product for many; torch's for other
  widths) over hypothesis' batches: experts with no tokens, one, more than STREAM_ROWS; k = 1, 2, 8;
  biases on and off; T = 0 and 1;
* `align` (kernels/fused_moe_kernel.py): every pair once, in its expert's run, runs padded to the tile;
  on meta tensors, so that no step reads a device value on the host (a CUDA graph could not capture it);
* the fused Triton kernel under TRITON_INTERPRET=1, in one child process (the variable must be set before
  triton is imported): fp32 against the loop and the grouped path, fp16 loosely, every tile config, and
  the engine's MoE layers (qwen3_moe's SiLU, gpt-oss' clamped SwiGLU with biases) fused against grouped.
  bf16 cannot run there (the interpreter's tl.dot multiplies bf16's raw bits, triton-lang/triton#11584):
  tools/gpu_check.py's moe section checks it on a GPU.

Tolerances: float32 sums of at most H + I products per output (a few hundred) round to about that many
ulps of the largest term; 16-bit inputs round every product's operands to 8 or 11 bits.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from orca_mq.engine.layer_ops import TorchOps  # noqa: E402
from orca_mq.models.layers.mlp import gelu_mul  # noqa: E402
from orca_mq.models.layers.moe import STREAM_ROWS, grouped  # noqa: E402

Tensor = torch.Tensor
FP32_TOL = 1e-5          # (H + I) * 2^-23 for the widths below, rounded up
LOOSE_TOL = {torch.float16: 5e-3, torch.bfloat16: 4e-2}
ACTS: dict[str, Callable[[Tensor], Tensor]] = {"silu": TorchOps().silu_mul, "gelu": gelu_mul}


@pytest.fixture(autouse=True)
def one_thread():
    """Products of a few dozen rows: a second thread only adds its hand-offs (seconds on a loaded host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def per_token(x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, act: Callable[[Tensor], Tensor],
              gate_up_b: Tensor | None = None, down_b: Tensor | None = None) -> Tensor:
    """Float64, one (token, expert) at a time."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            h = gate_up[e].double() @ x[t].double() + (0 if gate_up_b is None else gate_up_b[e].double())
            y = down[e].double() @ act(h[None])[0] + (0 if down_b is None else down_b[e].double())
            out[t] += weights[t, j].double() * y
    return out


def make_case(seed: int, t: int, e: int, k: int, h: int, i: int, bias: bool, crowd: bool,
              dtype: torch.dtype = torch.float32) -> dict:
    """Random experts and routing; `crowd`: expert 0 in every token's k (T rows on one expert)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
    if crowd and t:
        ids[:, 0] = torch.where((ids == 0).any(1), ids[:, 0], 0)   # expert 0 once per token (k distinct)
    weights = torch.rand(t, k, generator=g)
    case = dict(x=torch.randn(t, h, generator=g), gate_up=torch.randn(e, 2 * i, h, generator=g) / h ** 0.5,
                down=torch.randn(e, h, i, generator=g) / i ** 0.5, ids=ids,
                weights=weights / weights.sum(1, keepdim=True),
                gate_up_b=torch.randn(e, 2 * i, generator=g) if bias else None,
                down_b=torch.randn(e, h, generator=g) if bias else None)
    return {n: v.to(dtype) if v is not None and v.is_floating_point() else v for n, v in case.items()}


def rel_err(a: Tensor, ref: Tensor) -> float:
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), t=st.integers(0, 40), e=st.sampled_from([1, 3, 8, 12]), k=st.sampled_from([1, 2, 8]),
       h=st.sampled_from([16, 20, 64]), i=st.sampled_from([8, 12, 32]), bias=st.booleans(), crowd=st.booleans(),
       act=st.sampled_from(sorted(ACTS)), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_grouped_equals_per_token_loop(seed, t, e, k, h, i, bias, crowd, act, dtype):
    """Widths of 16 and 64 with intermediates of 8 and 32 take the streaming kernel (float32 and bfloat16),
    20 and 12 (not whole vectors of 8) torch's products; a crowded expert past STREAM_ROWS one product."""
    k = min(k, e)
    case = make_case(seed, t, e, k, h, i, bias, crowd, dtype)
    out = grouped(**case, act=ACTS[act])
    assert out.shape == (t, h) and out.dtype == dtype
    err = rel_err(out, per_token(**case, act=ACTS[act]))
    assert err <= (FP32_TOL if dtype == torch.float32 else LOOSE_TOL[dtype]), err


def test_grouped_streams_and_multiplies_in_one_call():
    """One expert with more rows than STREAM_ROWS beside experts of a few and experts of none, float32 at
    widths the extension takes: both branches of grouped_rows in one call, and its result the loop's."""
    case = make_case(5, 3 * STREAM_ROWS, 64, 2, 64, 32, True, True)
    assert int((case["ids"] == 0).sum()) > STREAM_ROWS and len(case["ids"].unique()) < 64
    act = ACTS["silu"]
    assert rel_err(grouped(**case, act=act), per_token(**case, act=act)) <= FP32_TOL


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), t=st.integers(1, 30), e=st.integers(1, 20), k=st.sampled_from([1, 2, 8]),
       block_m=st.sampled_from([1, 4, 16, 64]))
def test_align_places_every_pair_once_in_its_experts_padded_run(seed, t, e, k, block_m):
    from kernels.fused_moe_kernel import align

    k = min(k, e)
    ids = make_case(seed, t, e, k, 8, 8, False, False)["ids"]
    pairs, block_expert, used = align(ids, e, block_m)
    n, used = t * k, int(used)
    assert pairs.numel() % block_m == 0 and block_expert.numel() == pairs.numel() // block_m
    assert used <= pairs.numel() and used % block_m == 0
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n)) and bool((pairs[used:] == n).all())
    flat = ids.reshape(-1)
    for b in range(used // block_m):   # each block: one expert's pairs, that expert's, runs in expert order
        tile = pairs[b * block_m: (b + 1) * block_m]
        assert bool((flat[tile[tile < n].long()] == block_expert[b]).all())
    assert block_expert[: used // block_m].tolist() == sorted(block_expert[: used // block_m].tolist())
    counts = torch.bincount(flat, minlength=e)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())


def test_align_reads_nothing_on_the_host():
    """On meta tensors (shapes, no values) every step runs: nothing sizes a tensor from the data."""
    from kernels.fused_moe_kernel import align

    pairs, block_expert, used = align(torch.zeros(5, 8, dtype=torch.long, device="meta"), 128, 16)
    assert pairs.shape == (40 + 40 * 15,) and block_expert.shape == (pairs.shape[0] // 16,) and used.shape == (1,)


# ---------------------------------------------------------------------------------------------------
# The fused kernel, in a child process under TRITON_INTERPRET=1
# ---------------------------------------------------------------------------------------------------

# name: (T, E, k, H, I, bias, crowd, act, dtype); the kernel's two tile configs: pairs <= 16 E, and more
FUSED_CASES = {
    "T0": (0, 4, 2, 32, 16, False, False, "silu", "float32"),
    "T1_k8_of_8": (1, 8, 8, 32, 16, True, False, "silu", "float32"),
    "T1_k1": (1, 4, 1, 48, 24, False, False, "gelu", "float32"),
    "k2_idle_experts": (5, 12, 2, 32, 16, True, False, "silu", "float32"),
    "k2_crowded_multi_tile": (70, 4, 2, 32, 24, True, True, "silu", "float32"),
    "k8_wide_tiles": (20, 8, 8, 40, 20, False, False, "gelu", "float32"),
    "k2_fp16": (9, 6, 2, 32, 16, True, False, "silu", "float16"),
    "k8_fp16_wide_tiles": (20, 8, 8, 32, 16, False, True, "gelu", "float16"),
}
ENGINE_FAMILIES = ("qwen3_moe", "gpt_oss")


def _fused_check(name: str) -> dict:
    from kernels.fused_moe_kernel import fused_moe

    t, e, k, h, i, bias, crowd, act, dtype = FUSED_CASES[name]
    dt = getattr(torch, dtype)
    case = make_case(list(FUSED_CASES).index(name), t, e, k, h, i, bias, crowd, dt)
    out = fused_moe(**case, act=ACTS[act])
    err = rel_err(out, per_token(**case, act=ACTS[act]))
    if dt == torch.float32:   # and the grouped path, the one the engine takes on the CPU
        err = max(err, rel_err(out, grouped(**case, act=ACTS[act]).double()))
    ok = out.shape == (t, h) and out.dtype == dt and err <= (FP32_TOL if dt == torch.float32 else LOOSE_TOL[dt])
    return dict(ok=bool(ok), err=err)


def _engine_check(family: str, root: str) -> dict:
    """A tiny random checkpoint's prompt iteration: its MoE layers fused against grouped, fp32 logits."""
    from pathlib import Path

    from orca_mq.bench.plans import block_tables
    from orca_mq.bench.random_models import family_config, save_random_model
    from orca_mq.config import load_config
    from orca_mq.engine.model_runner import ModelRunner
    from orca_mq.models.layers.moe import MoE
    from orca_mq.protocol.iteration import IterationPlan, SeqWork

    path = save_random_model(Path(root) / family, family_config(family, layers=2))
    runner = ModelRunner(load_config(overrides={"model.path": str(path), "engine.block_size": 8, "engine.n_slots": 256,
                                                "engine.attention_backend": "torch", "model.dtype": "float32",
                                                "engine.threads_per_worker": 1}))
    g = torch.Generator().manual_seed(3)
    lengths = (9, 4, 1)
    plan = IterationPlan(1, [SeqWork(f"r{r}", torch.randint(3, 256, (n,), generator=g).tolist(), 0, table)
                             for r, (n, table) in enumerate(zip(lengths, block_tables(lengths, 8)))])
    moes = [m for m in runner.model.mlps if isinstance(m, MoE)]
    got = {}
    for fused in (False, True):
        for m in moes:
            m.fused = fused
        got[fused] = runner.forward(plan)
    err = rel_err(got[True], got[False].double())
    return dict(ok=bool(moes) and err <= 1e-4, err=err)   # logits: as tests/test_families.py's TOL


def _child_main(root: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    checks = {**{n: (lambda n=n: _fused_check(n)) for n in FUSED_CASES},
              **{f"engine_{f}": (lambda f=f: _engine_check(f, root)) for f in ENGINE_FAMILIES}}
    results = {}
    for name, fn in checks.items():
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - report it, run the others
            results[name] = dict(ok=False, err=float("inf"), error=f"{type(e).__name__}: {e}")
    print("@@RESULTS@@" + json.dumps(results))


@pytest.fixture(scope="module")
def fused_results(tmp_path_factory) -> dict:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(tmp_path_factory.mktemp("moe"))],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULTS@@")]
    if proc.returncode != 0 or not marker:
        pytest.fail(f"fused MoE child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(marker[-1][len("@@RESULTS@@"):])


@pytest.mark.parametrize("check", [*FUSED_CASES, *(f"engine_{f}" for f in ENGINE_FAMILIES)])
def test_fused_kernel(fused_results, check):
    r = fused_results[check]
    assert r["ok"], f"{check}: rel err {r['err']:.3g} {r.get('error', '')}"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    _child_main(sys.argv[2])


def test_gpu_check_moe_section_is_skipped_cleanly_on_the_cpu(tmp_path):
    """tools/gpu_check.py's moe section (orca_mq/bench/gpu_moe.py) needs CUDA: here one row says so, exit 0."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "gpu_check.py"), "run", "--small",
                           "--sections", "moe", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = [r for r in json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"] if r["section"] == "moe"]
    assert [r["figure"] for r in rows if "figure" in r] == ["fused MoE kernel: skipped (no CUDA)"]
    assert [r["exit"] for r in rows if r.get("detail") == "section done"] == [0]
