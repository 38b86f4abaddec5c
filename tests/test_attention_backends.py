"""One attention interface: resolve() by name, device, dtype and capability, and model.dtype = auto by CPU flags."""
from __future__ import annotations

import pytest
import torch

from orca_mq.engine import dtype as dtype_mod
from orca_mq.engine.attention import BACKENDS, BackendUnavailable, resolve
from orca_mq.engine.dtype import resolve_dtype

CPU = torch.device("cpu")


def test_registry_and_auto_choice_on_the_cpu():
    assert set(BACKENDS) == {"torch", "cpu", "triton"}
    assert resolve("auto", CPU, torch.float32).name == "cpu"      # the C++ decode kernel builds here
    assert resolve("auto", CPU, torch.bfloat16).name == "cpu"
    assert resolve("auto", CPU, torch.float16).name == "torch"    # no float16 kernel: the torch path
    assert resolve("torch", CPU, torch.float32).name == "torch"
    with pytest.raises(BackendUnavailable, match="float32 or bfloat16"):
        resolve("cpu", CPU, torch.float16)
    with pytest.raises(ValueError, match="attention_backend"):
        resolve("flash", CPU, torch.float32)


def test_triton_is_never_auto_on_the_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")       # would make the kernels usable on CPU tensors
    assert resolve("auto", CPU, torch.float32).name == "cpu"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailable, match="Triton"):
        resolve("triton", CPU, torch.float32)


@pytest.mark.parametrize("flags,expected", [({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
                                            ({"avx2", "amx_bf16"}, "bfloat16"), ({"avx2", "avx512f"}, "float32")])
def test_auto_dtype_follows_native_bf16(monkeypatch, flags, expected):
    monkeypatch.setattr(dtype_mod, "cpu_flags", lambda: frozenset(flags))
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("float16", "cpu") == "float16"   # an explicit dtype is kept
