"""The tensors of a checkpoint, by name, as float32: a Hugging Face directory's safetensors files (MXFP4
experts dequantized) or a GGUF file's (every ggml type the gguf package reads, dequantized). Shapes are
known without reading the data (nor importing torch: the launcher's start-up check reads them), so a
checkpoint is checked against its config before any worker starts."""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

MAX_HEADER_BYTES = 100_000_000   # the safetensors format's own bound on a file's header
# e2m1 values of the 16 FP4 codes (OCP microscaling; what gpt-oss ships its experts in)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class SafetensorsSource:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: dict[str, Path] = {}               # each tensor's file
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.handles: dict[Path, Any] = {}             # safetensors' readers, opened by the first `get` of a file
        for f in sorted(path.glob("*.safetensors")):
            for k, v in _header(f).items():
                if k != "__metadata__":
                    self.files[k], self.shapes[k] = f, tuple(v["shape"])
        if not self.files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")

    def _key(self, name: str) -> str | None:
        for k in (name, f"transformer.{name}"):
            if k in self.files:
                return k
        return None

    def _tensor(self, key: str) -> Tensor:
        from safetensors import safe_open

        f = self.files[key]
        if f not in self.handles:
            self.handles[f] = safe_open(str(f), framework="pt")
        return self.handles[f].get_tensor(key)

    def has(self, name: str) -> bool:
        return self._key(name) is not None or self._key(name + "_blocks") is not None

    def shape(self, name: str) -> tuple[int, ...]:
        key = self._key(name)
        if key is not None:
            return self.shapes[key]
        blocks = self._key(name + "_blocks")
        if blocks is None:
            raise KeyError(name)
        e, rows, groups, width = self.shapes[blocks]
        return (e, groups * width * 2, rows)

    def get(self, name: str) -> Tensor:
        key = self._key(name)
        if key is not None:
            return self._tensor(key).float()
        blocks, scales = self._key(name + "_blocks"), self._key(name + "_scales")
        if blocks is None or scales is None:
            raise KeyError(name)
        return dequantize_mxfp4(self._tensor(blocks), self._tensor(scales))


def _header(file: Path) -> dict[str, Any]:
    """A safetensors file's header, {name: {dtype, shape, data_offsets}} (and __metadata__), checked as
    safetensors' own reader checks it (every size a count, each tensor's bytes its shape's, the data
    covered exactly: a shard cut short is refused here, not in a worker); a ValueError naming the file."""
    size = file.stat().st_size
    with file.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{file}: not a safetensors file (a header of {n} bytes in a file of {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        spans = [_span(k, v) for k, v in header.items() if k != "__metadata__"] if isinstance(header, dict) else None
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{file}: not a safetensors file ({str(e) or 'its header cannot be read'})") from None
    if spans is None:
        raise ValueError(f"{file}: not a safetensors file (its header is not an object)")
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise ValueError(f"{file}: its tensors' data does not cover the file in order (a gap or an overlap at byte {begin})")
        end = stop
    if end != size - 8 - n:
        raise ValueError(f"{file}: its header places {end} bytes of data, the file holds {size - 8 - n} (cut short?)")
    return header


DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _span(name: str, entry: Any) -> tuple[int, int]:
    """A tensor's [begin, end) in the data, where its entry is sound."""
    if not isinstance(entry, dict) or not isinstance(shape := entry.get("shape"), list) \
            or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: its shape is not a list of counts")
    offsets, width = entry.get("data_offsets"), DTYPE_BYTES.get(entry.get("dtype"))   # type: ignore[arg-type]
    if width is None:
        raise ValueError(f"tensor {name!r}: dtype {entry.get('dtype')!r} cannot be read")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"tensor {name!r}: its data_offsets are not two ordered byte counts")
    if offsets[1] - offsets[0] != math.prod(shape) * width:
        raise ValueError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for {shape} of {entry['dtype']}")
    return offsets[0], offsets[1]


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """MXFP4 [E, rows, G, 16] bytes (two e2m1 codes each, low nibble first) and [E, rows, G] e8m0 scales ->
    float32 [E, G * 32, rows]: the [in, out] per expert that transformers' gpt-oss experts hold."""
    import torch

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
        import torch
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
