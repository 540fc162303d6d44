"""Serialisation of a weight set for the data plane: the safetensors format, so any language can read it.

Writing uses the safetensors library. Reading parses the (simple, documented) format directly from
the data plane's buffer so the tensors are views into it: no copy of a multi-GB payload just to
satisfy ``safetensors.torch.load``, which only accepts ``bytes``.
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
}


class PayloadFormatError(ValueError):
    """A weight payload that is not a well-formed safetensors buffer."""


def serialize_state(state: dict[str, torch.Tensor], version: int) -> bytes:
    """Contiguous CPU tensors -> safetensors bytes, the version in the header metadata."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
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
        if not 0 <= start <= end <= len(data) or (end - start) != math.prod(shape) * dtype.itemsize:
            raise PayloadFormatError(f"{name}: data offsets {start}..{end} do not fit shape {shape} {dtype}")
        if end == start:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(data[start:end], dtype=dtype).view(shape)
    return out
