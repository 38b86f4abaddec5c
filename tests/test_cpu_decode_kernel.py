"""The C++ paged decode kernel (kernels/csrc/paged_decode_cpu.cpp) equals gather + SDPA on scattered blocks:
to float32 rounding with a float32 cache, to the output's bfloat16 rounding with a bfloat16 cache
(judged against float32 SDPA over the same bfloat16 values)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_kernels


def _reference(q, k_cache, v_cache, tables, lens, scale):
    b, n_heads, d = q.shape
    bs, kvh = k_cache.shape[1:3]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(lens[i])
        blocks = tables[i, : -(-n // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, d)[:n].transpose(0, 1)
        v = v_cache[blocks].reshape(-1, kvh, d)[:n].transpose(0, 1)
        out[i] = F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=scale,
                                                enable_gqa=n_heads != kvh).squeeze(1)
    return out


@pytest.mark.parametrize("head_dim", [64, 128, 24])   # 64/128 take the compile-time paths, 24 the generic one
@pytest.mark.parametrize("n_heads,n_kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_gather_sdpa(head_dim, n_heads, n_kv_heads, table_dtype, dtype):
    ext = cpu_kernels.load()
    assert ext is not None, "the CPU kernels must build on this machine (gcc is required)"
    kernel = ext.paged_decode_attention
    gen = torch.Generator().manual_seed(head_dim * 100 + n_heads)
    block_size, num_blocks, batch = 8, 96, 7
    k_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    lens = torch.tensor([1, 8, 9, 17, 40, 63, 5], dtype=torch.int32)  # one token, exact blocks, partial blocks
    max_blocks = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks).to(table_dtype)
    q = torch.randn(batch, n_heads, head_dim, generator=gen) * 3  # large scores exercise the running max
    scale = head_dim ** -0.5
    q, k_cache, v_cache = (t.to(dtype) for t in (q, k_cache, v_cache))
    ours = kernel(q, k_cache, v_cache, tables, lens, scale)
    expected = _reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    assert ours.dtype == dtype
    # float32: summation order only; bfloat16: the output's rounding (8 bits of mantissa)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8 * expected.abs().max().item()
    assert (ours.float() - expected).abs().max().item() <= tol


@pytest.mark.parametrize("window,softcap,sinks", [(7, 0.0, False), (16, 0.0, False), (0, 2.5, False), (0, 0.0, True),
                                                   (9, 4.0, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_options_match_the_reference(window, softcap, sinks, dtype):
    """A layer's sliding window (whole blocks before it skipped), soft-capping and sinks, as the kernels'
    reference (kernels/reference.py, itself checked against transformers' eager attention) computes them."""
    from kernels.reference import ragged_paged_attention_ref

    kernel = cpu_kernels.load().paged_decode_attention
    gen = torch.Generator().manual_seed(window * 10 + int(sinks))
    block_size, num_blocks, batch, n_heads, kvh, d = 8, 96, 7, 6, 2, 64
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(dtype) for _ in range(2))
    lens = torch.tensor([1, 8, 9, 17, 40, 63, 5], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * 8].view(batch, 8).to(torch.int32)
    q = (torch.randn(batch, n_heads, d, generator=gen) * 3).to(dtype)
    sink = torch.randn(n_heads, generator=gen) * 2 if sinks else None
    ours = kernel(q, k_cache, v_cache, tables, lens, d ** -0.5, window, softcap, sink)
    expected = ragged_paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables,
                                          torch.arange(batch + 1, dtype=torch.int32), lens, d ** -0.5,
                                          window=window, softcap=softcap, sinks=sink)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8 * expected.abs().max().item()
    assert (ours.float() - expected).abs().max().item() <= tol


def test_kernel_rejects_wrong_dtype():
    kernel = cpu_kernels.load().paged_decode_attention
    q = torch.randn(1, 2, 8, dtype=torch.float64)
    cache = torch.randn(4, 2, 2, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)


def test_a_builder_killed_mid_build_does_not_hang_later_loads():
    """torch's file lock outlives a killed builder; the next load must not wait on it forever."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    if cpu_kernels.load() is None:
        pytest.skip("no compiler here: the engine uses the torch path")
    stale = Path(_get_build_directory(cpu_kernels._build_name(cpu_kernels.source_text()), verbose=False)) / "lock"
    stale.touch()  # what a SIGKILLed build leaves behind
    probe = subprocess.run([sys.executable, "-c", "from kernels import cpu_kernels; print(cpu_kernels.load() is not None)"],
                           capture_output=True, text=True, timeout=300, cwd=Path(cpu_kernels.__file__).parents[1])
    assert probe.stdout.strip() == "True", probe.stderr
    assert not stale.exists()


def test_the_build_is_keyed_by_its_environment_and_says_when_it_builds(tmp_path, monkeypatch, capsys):
    """Two environments on one machine (another torch, compiler or flags) keep a build each instead of
    rebuilding over each other; a build prints one line (it takes a while)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch.utils.cpp_extension as cpp_extension

    name = cpu_kernels._build_name(cpu_kernels.source_text())
    probe = "from kernels import cpu_kernels as k; print(k._build_name(k.source_text()))"
    for env in ({}, {"CXX": "another-c++"}):
        other = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                               env=os.environ | env, cwd=Path(cpu_kernels.__file__).parents[1])
        assert (other.stdout.strip() == name) == (not env), other.stderr
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))   # nothing built there: load() builds
    built = []
    monkeypatch.setattr(cpp_extension, "load_inline", lambda **kw: built.append(kw["name"]) or "the extension")
    assert cpu_kernels.load.__wrapped__() == "the extension" and built == [name]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "building the CPU kernels" in lines[0] and str(tmp_path) in lines[0], lines
