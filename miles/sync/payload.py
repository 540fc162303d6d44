"""Serialisation of a weight set for the data plane: the safetensors format, so any language can read it.

Writing uses the safetensors library. Reading parses the (simple, documented) format directly from
the data plane's buffer so the tensors are views into it: no copy of a multi-GB payload just to
satisfy ``safetensors.torch.load``, which only accepts ``bytes`` (and, in safetensors 0.8, cannot
load the FP8/FP4 rollout dtypes it writes).

Quantized rollout states (:mod:`miles.sync.precision`) use two dtypes with safetensors' own names:
``F8_E8M0`` (``torch.float8_e8m0fnu``, one byte per element) and ``F4`` (4-bit e2m1). An ``F4``
header shape counts 4-bit *elements*, so a ``torch.float4_e2m1fn_x2`` tensor of shape (r, c) (two
elements per byte) is written as shape (r, 2c), low nibble first, and read back as (r, c).
"""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import save as st_save

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,  # header shape in 4-bit elements: the last dim is twice torch's
}


class PayloadFormatError(ValueError):
    """A weight payload that is not a well-formed safetensors buffer."""


def serialize_state(state: dict[str, torch.Tensor], version: int) -> bytes:
    """Contiguous CPU tensors -> safetensors bytes, the version in the header metadata."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    for name, t in tensors.items():
        if t.dtype == torch.float4_e2m1fn_x2 and t.dim() == 0:  # safetensors has no 0-d packed-pair shape
            raise ValueError(f"{name}: a 0-d float4_e2m1fn_x2 tensor cannot be stored; give it shape (1,)")
    return st_save(tensors, metadata={"miles_policy_version": str(version)})


def deserialize_state(payload: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensors viewing ``payload`` (keep it alive while they are used)."""
    buf = memoryview(payload).cast("B")
    if len(buf) < 8:
        raise PayloadFormatError("payload shorter than the 8-byte safetensors header length")
    header_len = int.from_bytes(buf[:8], "little")
    if 8 + header_len > len(buf):
        raise PayloadFormatError(f"header length {header_len} exceeds payload size {len(buf)}")
    try:
        header = json.loads(bytes(buf[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadFormatError(f"header is not JSON: {exc}") from None
    data = buf[8 + header_len :]
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise PayloadFormatError(f"{name}: unsupported dtype {info.get('dtype')!r}")
        start, end = info["data_offsets"]
        shape = list(info["shape"])
        if dtype == torch.float4_e2m1fn_x2:  # F4: elements in the header, packed pairs in torch
            if not shape or shape[-1] % 2:
                raise PayloadFormatError(f"{name}: F4 shape {shape} does not split into e2m1 pairs")
            shape[-1] //= 2
        if not 0 <= start <= end <= len(data) or (end - start) != math.prod(shape) * dtype.itemsize:
            raise PayloadFormatError(f"{name}: data offsets {start}..{end} do not fit shape {shape} {dtype}")
        if end == start:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(data[start:end], dtype=dtype).view(shape)
    return out
