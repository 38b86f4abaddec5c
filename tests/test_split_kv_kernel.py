"""The split-KV decode kernel (kernels/split_kv_kernel.py), the e4m3 KV write (kv_fp8_kernel.py), FP8
GEMMs' activation rows (fp8_quant_kernel.py) and the ragged kernel at head_dim 128 for prompts,
against plain torch (issue 42, items 3 and 4).

The kernels run under TRITON_INTERPRET=1 on CPU tensors, in one child process (the variable only
works before triton is first imported: tests/test_triton_kernels.py says why), which prints a
JSON verdict per check. The reference is independent of the kernels: each row's keys gathered
through its block table, in float64, the window, softcap and sinks applied as their definitions say.
Tolerances: fp32 1e-4 of the output's scale (an fp32 reduction over <= 1k keys); bf16 inputs are
computed on in fp32, so only the output's rounding to bf16 remains: 2^-8 relative on a GPU (to
nearest), 2^-7 in the interpreter, which truncates (8e-3 of the scale).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

SEED = int(os.environ.get("ORCA_KERNEL_TEST_SEED", "20261201"))
FP32_TOL, BF16_TOL = 1e-4, 8e-3


def decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's one query over its keys, in float64."""
    rows, n_heads, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = []
    for b in range(rows):
        n = int(seq_lens[b])
        blocks = tables[b, : -(-n // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, d)[:n].double()
        v = v_cache[blocks].reshape(-1, kvh, d)[:n].double()
        if k_scale is not None:
            k = k * k_scale[blocks].reshape(-1, kvh)[:n, :, None].double()
            v = v * v_scale[blocks].reshape(-1, kvh)[:n, :, None].double()
        pos = n - 1   # the query's position: it sees keys k with pos - k < window
        seen = [j for j in range(n) if not window or pos - j < window]
        k, v = k[seen], v[seen]
        s = torch.einsum("hgd,nhd->hgn", q[b].double().view(kvh, -1, d), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:   # a logit more in each head's denominator, none in its numerator
            s = torch.cat([s, sinks.double().view(kvh, -1, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., : len(seen)]
        out.append(torch.einsum("hgn,nhd->hgd", p, v).reshape(n_heads, d))
    return torch.stack(out)


def make_case(gen: torch.Generator, contexts: list[int], n_heads: int, kv_heads: int, d: int, bs: int,
              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A NaN-poisoned paged cache holding each row's keys on shuffled blocks, its table padded with 0."""
    need = [-(-n // bs) for n in contexts]
    nb = sum(need) + 3
    perm = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    width = max(need) + 2
    tables = torch.zeros(len(contexts), width, dtype=torch.int32)
    k_cache = torch.full((nb, bs, kv_heads, d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    at = 0
    for b, n in enumerate(contexts):
        tables[b, : need[b]] = torch.tensor(perm[at: at + need[b]], dtype=torch.int32)
        at += need[b]
        slots = [int(tables[b, p // bs]) * bs + p % bs for p in range(n)]
        k_cache.view(-1, kv_heads, d)[slots] = torch.randn(n, kv_heads, d, generator=gen).to(dtype)
        v_cache.view(-1, kv_heads, d)[slots] = torch.randn(n, kv_heads, d, generator=gen).to(dtype)
    return {"q": torch.randn(len(contexts), n_heads, d, generator=gen).to(dtype), "k_cache": k_cache, "v_cache": v_cache,
            "tables": tables, "seq_lens": torch.tensor(contexts, dtype=torch.int32)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# (name, contexts, n_heads, kv_heads, head_dim, block_size, splits, options, dtype)
CASES = [
    ("gqa8x2_d64_plain", [1, 300, 517], 8, 2, 64, 16, 5, {}, "float32"),
    ("gqa8x2_d64_window_softcap_sinks", [1, 300, 517], 8, 2, 64, 16, 5,
     {"window": 100, "softcap": 30.0, "sinks": True}, "float32"),
    ("mha4_d16_bs8_more_splits_than_steps", [1, 9, 130], 4, 4, 16, 8, 12, {"window": 7}, "float32"),
    ("gqa9x3_d64_served_one_split", [40, 257], 9, 3, 64, 16, 1, {"sinks": True}, "float32"),
    ("gqa8x2_d128_window_past_context", [700, 33], 8, 2, 128, 16, 7, {"window": 4096, "softcap": 20.0}, "float32"),
    ("gqa8x2_d128_bf16", [700, 33], 8, 2, 128, 32, 3, {"window": 300, "softcap": 20.0, "sinks": True}, "bfloat16"),
]


def _check_split(gen: torch.Generator, contexts: list[int], n_heads: int, kv_heads: int, d: int, bs: int, splits: int,
                 options: dict[str, object], dtype: str) -> tuple[bool, float, str]:
    from kernels.split_kv_kernel import split_kv_decode

    c = make_case(gen, contexts, n_heads, kv_heads, d, bs, getattr(torch, dtype))
    opts = dict(options)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(n_heads, generator=gen) * 2
    scale = d ** -0.5
    out = split_kv_decode(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], scale, splits, **opts)
    err = rel_err(out, decode_ref(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], scale, **opts))
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    return out.dtype == c["q"].dtype and err <= tol, err, f"splits={splits} {options} tol={tol:g}"


def _interpreter_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (fp32) cast to e4m3 as the interpreter's Triton casts it: where rounding up carries into the
    exponent it drops the carry (124.3 -> 64, not 128), so its bytes can equal only its own cast's
    (a GPU rounds to nearest even, as torch: tools/gpu_check.py compares the kernel with torch there)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n).to(dst.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=offs < n)

    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    cast[(triton.cdiv(x.numel(), 1024),)](x.contiguous(), out, x.numel(), BLOCK=1024)
    return out


def _check_fp8(gen: torch.Generator) -> tuple[bool, float, str]:
    """The e4m3 write (its bytes equal engine/fp8.py's reference, padding slots skipped) and the
    split kernel's dequantizing loads (against the reference on the same e4m3 values and scales)."""
    from kernels.kv_fp8_kernel import write_kv_fp8
    from kernels.split_kv_kernel import split_kv_decode
    from orca_mq.engine.fp8 import quantize_rows

    contexts, n_heads, kvh, d, bs = [3, 60, 100], 8, 2, 64, 16
    c = make_case(gen, contexts, n_heads, kvh, d, bs)
    nb = c["k_cache"].shape[0]
    caches = [torch.zeros(nb, bs, kvh, d, dtype=torch.float8_e4m3fn) for _ in range(2)]
    scales = [torch.full((nb, bs, kvh), -1.0) for _ in range(2)]
    slots = torch.cat([torch.tensor([int(c["tables"][b, p // bs]) * bs + p % bs for p in range(n)])
                       for b, n in enumerate(contexts)])
    k = c["k_cache"].view(-1, kvh, d)[slots] * torch.logspace(-3, 2, len(slots))[:, None, None]   # many magnitudes
    v = c["v_cache"].view(-1, kvh, d)[slots]
    pad = slots.clone()
    pad[::7] = -1   # padding tokens: nothing written
    write_kv_fp8(k, v, *caches, *scales, pad)
    skipped = caches[0].view(-1, kvh, d)[slots[::7]]
    assert not skipped.float().any() and (scales[0].view(-1, kvh)[slots[::7]] == -1).all()
    write_kv_fp8(k[::7], v[::7], *caches, *scales, slots[::7])
    exact = True
    for x, cache, sc in ((k, caches[0], scales[0]), (v, caches[1], scales[1])):
        _, s = quantize_rows(x)
        quotient = (x / s).clamp(-448, 448)
        exact &= torch.equal(cache.view(-1, kvh, d)[slots].view(torch.uint8), _interpreter_e4m3(quotient).view(torch.uint8))
        exact &= torch.equal(sc.view(-1, kvh)[slots], s.squeeze(-1))
    out = split_kv_decode(c["q"], *caches, c["tables"], c["seq_lens"], d ** -0.5, 6, k_scale=scales[0], v_scale=scales[1],
                          window=50)
    err = rel_err(out, decode_ref(c["q"], *caches, c["tables"], c["seq_lens"], d ** -0.5, window=50,
                                  k_scale=scales[0], v_scale=scales[1]))
    return exact and err <= FP32_TOL, err, f"write bytes equal the reference: {exact}"


def _check_fp8_rows(gen: torch.Generator) -> tuple[bool, float, str]:
    """FP8 GEMMs' activation rows (kernels/fp8_quant_kernel.py): rows longer than one of the kernel's
    steps and not a multiple of it, strided, of many magnitudes, one all zero; the bytes are the
    reference's quotient cast as the interpreter casts, the scales engine/fp8.py's own."""
    from kernels.fp8_quant_kernel import BLOCK, quantize_rows_fp8
    from orca_mq.engine.fp8 import dequantize, quantize_rows

    n = 2 * BLOCK + 300
    wide = torch.randn(9, n + 64, generator=gen) * torch.logspace(-4, 4, 9)[:, None]
    wide[4] = 0.0
    x = wide[:, 32: 32 + n]   # a strided view
    q, scale = quantize_rows_fp8(x.to(torch.bfloat16))
    _, s = quantize_rows(x.to(torch.bfloat16))
    quotient = (x.to(torch.bfloat16).float() / s).clamp(-448, 448)
    exact = torch.equal(scale, s) and torch.equal(q.view(torch.uint8), _interpreter_e4m3(quotient).view(torch.uint8))
    err = rel_err(dequantize(q, scale), x.to(torch.bfloat16).float())   # shown only: the dropped carries dominate it
    return exact and q.shape == x.shape and scale.shape == (9, 1), err, f"bytes and scales equal: {exact}"


def _check_ragged_d128(gen: torch.Generator) -> tuple[bool, float, str]:
    """The ragged kernel at head_dim 128 (Llama 3, Qwen3) for prompts: whole, chunked on cached
    context, several tiles long, beside decodes."""
    import kernels
    from kernels.reference import ragged_paged_attention_ref

    ctxs, qlens = [0, 37, 0, 90, 5], [100, 40, 1, 1, 33]
    seq = [c + q for c, q in zip(ctxs, qlens)]
    c = make_case(gen, seq, 8, 2, 128, 16)
    q = torch.randn(sum(qlens), 8, 128, generator=gen)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    args = (c["k_cache"], c["v_cache"], c["tables"], cu, c["seq_lens"], 128 ** -0.5)
    err = rel_err(kernels.ragged_paged_attention(q, *args), ragged_paged_attention_ref(q, *args))
    return err <= FP32_TOL, err, f"q_lens={qlens} ctx={ctxs}"


def _check_backend(gen: torch.Generator) -> tuple[bool, float, str]:
    """The engine's triton backend: an iteration of one-token rows over long tables takes the split
    path (its output bit-identical to the kernel's at the chosen splits), a mixed one does not."""
    from types import SimpleNamespace

    from kernels.split_kv_kernel import INTERPRETER_SMS, choose_splits, decode, split_kv_decode
    from orca_mq.engine.attention import AttentionSpec, resolve

    backend = resolve("triton", torch.device("cpu"), torch.float32)
    c = make_case(gen, [300, 20], 8, 2, 64, 16)
    splits = choose_splits(2, 2, c["tables"].shape[1] * 16, INTERPRETER_SMS)
    meta = SimpleNamespace(block_tables=c["tables"], seq_lens=c["seq_lens"], cu_q_lens=torch.tensor([0, 1, 2], dtype=torch.int32),
                           decode_tiles=None)
    out = backend.attend(c["q"], None, None, c["k_cache"], c["v_cache"], meta, AttentionSpec(0.125))
    split = split_kv_decode(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], 0.125, splits)
    err = rel_err(out, decode_ref(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], 0.125))
    backend.split_kv = False   # deterministic mode: the ragged kernel
    ragged = backend.attend(c["q"], None, None, c["k_cache"], c["v_cache"], meta, AttentionSpec(0.125))
    mixed = decode(torch.cat([c["q"], c["q"][:1]]), c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], 0.125)
    ok = splits > 1 and torch.equal(out, split) and not torch.equal(ragged, split) and rel_err(ragged, out) <= FP32_TOL
    ok = ok and mixed is None   # three tokens over two rows: a prompt chunk, the ragged kernel's
    return ok and err <= FP32_TOL, err, f"splits={splits}"


def _child(seed: int) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    checks = {name: (lambda g, a=args: _check_split(g, *a)) for name, *args in CASES}
    checks |= {"fp8_write_and_read": _check_fp8, "fp8_activation_rows": _check_fp8_rows, "ragged_d128_fp32": _check_ragged_d128,
               "backend_dispatch": _check_backend}
    for name, check in checks.items():
        gen = torch.Generator().manual_seed(seed + sum(map(ord, name)))
        try:
            ok, err, info = check(gen)
            row = {"ok": bool(ok), "err": err if math.isfinite(err) else "inf", "info": info}
        except Exception as e:   # noqa: BLE001 - the verdict says what failed
            row = {"ok": False, "err": "inf", "info": f"{type(e).__name__}: {e}"}
        print(json.dumps({name: row}), flush=True)


@pytest.fixture(scope="module")
def verdicts() -> dict[str, dict[str, object]]:
    run = subprocess.run([sys.executable, __file__, "--child", str(SEED)], capture_output=True, text=True, timeout=600,
                         env=os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": REPO})
    out: dict[str, dict[str, object]] = {}
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            out |= json.loads(line)
    assert out, run.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", [c[0] for c in CASES] + ["fp8_write_and_read", "fp8_activation_rows", "ragged_d128_fp32",
                                                          "backend_dispatch"])
def test_kernel_against_plain_torch(verdicts: dict[str, dict[str, object]], name: str) -> None:
    v = verdicts[name]
    assert v["ok"], f"{name}: rel err {v['err']} ({v['info']}, seed {SEED})"


def test_the_reference_matches_sdpa_on_a_plain_case() -> None:
    """decode_ref without options is what SDPA computes over each row's keys (HF's repeat_kv for GQA)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(SEED)
    c = make_case(gen, [5, 70], 6, 2, 16, 8)
    ref = decode_ref(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], 0.25)
    for b, n in enumerate([5, 70]):
        blocks = c["tables"][b, : -(-n // 8)].long()
        k = c["k_cache"][blocks].reshape(-1, 2, 16)[:n].transpose(0, 1).repeat_interleave(3, 0)
        v = c["v_cache"][blocks].reshape(-1, 2, 16)[:n].transpose(0, 1).repeat_interleave(3, 0)
        sdpa = F.scaled_dot_product_attention(c["q"][b][:, None], k, v, scale=0.25)[:, 0]
        assert rel_err(sdpa, ref[b]) <= 1e-6


def test_splits_follow_the_sm_count() -> None:
    from kernels.split_kv_kernel import MAX_SPLITS, MIN_SPLIT_KEYS, WAVES, choose_splits

    assert choose_splits(132, 1, 32768, 132) == 1 == choose_splits(17, 8, 32768, 132)   # rows x KV heads fill the card
    assert choose_splits(1, 8, 32768, 132) == -(-WAVES * 132 // 8) == 33
    assert choose_splits(1, 8, 4 * MIN_SPLIT_KEYS, 132) == 4   # short tables: a split keeps MIN_SPLIT_KEYS keys
    assert choose_splits(1, 1, 1 << 20, 132) == MAX_SPLITS
    assert choose_splits(1, 8, 16, 132) == 1


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(int(sys.argv[2]))
