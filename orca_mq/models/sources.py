"""The tensors of a checkpoint, by name, as float32: a Hugging Face directory's safetensors files (MXFP4
experts dequantized) or a GGUF file's (every ggml type the gguf package reads, dequantized). Shapes are
known without reading the data, so a checkpoint is checked against its config before any worker starts."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

Tensor = torch.Tensor
# e2m1 values of the 16 FP4 codes (OCP microscaling; what gpt-oss ships its experts in)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class SafetensorsSource:
    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        self.handles = {}
        for f in sorted(path.glob("*.safetensors")):
            h = safe_open(str(f), framework="pt")
            for k in h.keys():
                self.handles[k] = h
        if not self.handles:
            raise FileNotFoundError(f"{path}: no *.safetensors files")

    def _key(self, name: str) -> str | None:
        for k in (name, f"transformer.{name}"):
            if k in self.handles:
                return k
        return None

    def has(self, name: str) -> bool:
        return self._key(name) is not None or self._key(name + "_blocks") is not None

    def shape(self, name: str) -> tuple[int, ...]:
        key = self._key(name)
        if key is not None:
            return tuple(self.handles[key].get_slice(key).get_shape())
        blocks = self._key(name + "_blocks")
        if blocks is None:
            raise KeyError(name)
        e, rows, groups, width = self.handles[blocks].get_slice(blocks).get_shape()
        return (e, groups * width * 2, rows)

    def get(self, name: str) -> Tensor:
        key = self._key(name)
        if key is not None:
            return self.handles[key].get_tensor(key).float()
        blocks, scales = self._key(name + "_blocks"), self._key(name + "_scales")
        if blocks is None or scales is None:
            raise KeyError(name)
        return dequantize_mxfp4(self.handles[blocks].get_tensor(blocks), self.handles[scales].get_tensor(scales))


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """MXFP4 [E, rows, G, 16] bytes (two e2m1 codes each, low nibble first) and [E, rows, G] e8m0 scales ->
    float32 [E, G * 32, rows]: the [in, out] per expert that transformers' gpt-oss experts hold."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    out = torch.empty(*b.shape[:-1], b.shape[-1] * 2, dtype=torch.float32)
    out[..., 0::2] = lut[(b & 0x0F).long()]
    out[..., 1::2] = lut[(b >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1))
    e, rows = out.shape[:2]
    return out.reshape(e, rows, -1).transpose(1, 2).contiguous()


class GGUFSource:
    def __init__(self, path: Path) -> None:
        from orca_mq.models.gguf_meta import gguf_reader

        self.path = path
        self.tensors = {t.name: t for t in gguf_reader(path).tensors}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        self.check_type(name)
        return tuple(reversed([int(d) for d in self.tensors[name].shape]))

    def check_type(self, name: str) -> None:
        """A ValueError naming the file, the tensor and its type when the gguf package cannot dequantize it."""
        kind = self.tensors[name].tensor_type
        if not _readable(kind):
            raise ValueError(f"{self.path}: tensor {name} has ggml type {kind.name}, which orca-mq cannot read "
                             f"(F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K and IQ types, MXFP4 are)")

    def get(self, name: str) -> Tensor:
        from gguf import GGMLQuantizationType, dequantize

        t = self.tensors[name]
        self.check_type(name)
        plain = t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        data = np.array(t.data, dtype=np.float32) if plain else dequantize(t.data, t.tensor_type)  # copy: the mmap is read-only
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).reshape(self.shape(name))


@functools.cache
def _readable(kind: object) -> bool:
    """Whether the gguf package dequantizes this ggml type (tried on one zero block)."""
    from gguf import GGML_QUANT_SIZES, dequantize

    block, size = GGML_QUANT_SIZES[kind]   # type: ignore[index]
    try:
        dequantize(np.zeros((1, size * (256 // block if block > 1 else 256)), np.uint8), kind)  # type: ignore[arg-type]
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


Source = SafetensorsSource | GGUFSource


def open_source(path: Path) -> Source:
    return GGUFSource(path) if path.is_file() else SafetensorsSource(path)
