"""Rollout precision: the exact tensors the trainer publishes, and the way back to a model state dict.

Rollout must see the *same* quantized weights as the trainer evaluates and audits, so quantization
happens once, on the trainer, with the deterministic CPU codec of :mod:`miles.sync.quant`; workers
only dequantize. Published names (``sync.dtype``):

* ``bfloat16`` / ``float32``: every floating tensor cast, same names.
* ``fp8_e4m3``: each quantizable tensor ``name`` -> e4m3 codes (same shape) plus ``name + ".qscale"``
  -> float32 scalar (shape ``()``, a power of two); everything else bfloat16.
* ``fp4_e2m1``: each quantizable tensor ``name`` (rows, cols) -> ``float4_e2m1fn_x2`` codes shaped
  (rows, cols // 2) plus ``name + ".qscale"`` -> ``float8_e8m0fnu`` block scales shaped
  (rows, cols // 32); everything else bfloat16.

Quantizable: a 2-D ``.weight`` of a decoder linear layer, i.e. no ``embed``, ``lm_head`` or ``norm``
in the name (and for fp4, ``cols % 32 == 0``, so every 32-element block lies inside one row).

:func:`state_digest` fingerprints such a state (names, dtypes, shapes, bits): the trainer announces it
and workers report the digest of what they hold, so the controller can flag any divergence.
"""

from __future__ import annotations

import torch
import xxhash

from miles.sync.quant import FP4_BLOCK, dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8

SCALE_SUFFIX = ".qscale"
PRECISIONS: tuple[str, ...] = ("bfloat16", "float32", "fp8_e4m3", "fp4_e2m1")
_CAST: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_QUANTIZED = ("fp8_e4m3", "fp4_e2m1")
_EXCLUDED = ("embed", "lm_head", "norm")


def is_quantized(precision: str) -> bool:
    """True for the precisions that publish codes plus ``.qscale`` scales."""
    _check_precision(precision)
    return precision in _QUANTIZED


def is_quantizable(name: str, tensor: torch.Tensor, precision: str) -> bool:
    """Whether ``to_rollout_state`` quantizes this tensor at ``precision``."""
    if not is_quantized(precision):
        return False
    if tensor.dim() != 2 or not name.endswith(".weight") or not tensor.is_floating_point():
        return False
    if any(word in name for word in _EXCLUDED):
        return False
    return precision != "fp4_e2m1" or tensor.shape[1] % FP4_BLOCK == 0


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown rollout precision {precision!r} (expected one of {', '.join(PRECISIONS)})")


def to_rollout_state(state: dict[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    """The tensors published for ``state`` (HF names, any float dtype) at ``precision``.

    Deterministic: the same input gives the same bits, on any machine. Quantized tensors (and their
    scales) are computed on CPU, because the codec is a CPU emulation and CPU float ops are the ones
    we can vouch for bit-for-bit; cast-only tensors keep their device. Non-floating tensors (integer
    buffers) are passed through unchanged.
    """
    _check_precision(precision)
    for name in state:
        if name.endswith(SCALE_SUFFIX):
            raise ValueError(f"{name}: a model state dict must not contain '{SCALE_SUFFIX}' names")
    out: dict[str, torch.Tensor] = {}
    cast = _CAST.get(precision, torch.bfloat16)  # quantized modes: everything not quantized is bf16
    for name, tensor in state.items():
        t = tensor.detach()
        if is_quantizable(name, t, precision):
            rows, cols = t.shape
            t = t.to("cpu")
            if precision == "fp8_e4m3":
                codes, scale = quantize_fp8(t)
                out[name] = codes
                out[name + SCALE_SUFFIX] = scale.reshape(()).to(torch.float32)
            else:
                packed, scales = quantize_fp4(t.contiguous())
                out[name] = packed.reshape(rows, cols // 2)
                out[name + SCALE_SUFFIX] = scales.reshape(rows, cols // FP4_BLOCK)
        elif t.is_floating_point():
            out[name] = t.to(cast)
        else:
            out[name] = t
    return out


def from_rollout_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A published state back to a model state dict (HF names, no ``.qscale``) in ``dtype``.

    Codes are dequantized with their scales; every other floating tensor is cast. A missing,
    orphaned or ill-shaped scale raises ``ValueError`` naming the tensor: applying codes with a
    wrong scale would silently give the worker different weights from the trainer's.
    """
    for name in state:
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] not in state:
            raise ValueError(f"{name}: scale without its tensor {name[: -len(SCALE_SUFFIX)]!r}")
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = state.get(name + SCALE_SUFFIX)
        if t.dtype == torch.float8_e4m3fn:
            out[name] = _dequantize_fp8(name, t, scale, dtype)
        elif t.dtype == torch.float4_e2m1fn_x2:
            out[name] = _dequantize_fp4(name, t, scale, dtype)
        elif scale is not None:
            raise ValueError(f"{name}: has a '{SCALE_SUFFIX}' but is {t.dtype}, not fp8/fp4 codes")
        elif t.is_floating_point():
            out[name] = t.to(dtype)
        else:
            out[name] = t
    return out


def _dequantize_fp8(name: str, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        raise ValueError(f"{name}: fp8 codes without a '{name}{SCALE_SUFFIX}' scale")
    if scale.shape != () or scale.dtype != torch.float32:
        raise ValueError(
            f"{name}: fp8 scale must be a float32 scalar of shape (), got {scale.dtype} {tuple(scale.shape)}"
        )
    return dequantize_fp8(codes.to("cpu"), scale.to("cpu"), dtype=dtype)


def _dequantize_fp4(name: str, packed: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scales is None:
        raise ValueError(f"{name}: fp4 codes without a '{name}{SCALE_SUFFIX}' scale")
    if packed.dim() != 2 or (2 * packed.shape[1]) % FP4_BLOCK:
        raise ValueError(
            f"{name}: fp4 codes must be 2-D with 2 * cols a multiple of {FP4_BLOCK}, got {tuple(packed.shape)}"
        )
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    want = (rows, cols // FP4_BLOCK)
    if scales.dtype != torch.float8_e8m0fnu or tuple(scales.shape) != want:
        raise ValueError(
            f"{name}: fp4 scales must be float8_e8m0fnu of shape {want}, got {scales.dtype} {tuple(scales.shape)}"
        )
    return dequantize_fp4(packed.to("cpu").contiguous(), scales.to("cpu").contiguous(), (rows, cols), dtype=dtype)


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """xxh3-128 hex over the sorted names, dtype names, shapes and raw bytes of ``state``.

    Stable across processes and machines (no pointer, stride or device enters it) and sensitive to a
    single flipped bit, a renamed tensor, a changed dtype or a reshape. Each tensor contributes a
    length-framed header, so no two different states can produce the same byte stream.
    """
    h = xxhash.xxh3_128()
    for name in sorted(state):
        t = state[name].detach()
        dtype_name = str(t.dtype).removeprefix("torch.")
        raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)  # bytes as stored, no per-element work
        header = f"{name}\0{dtype_name}\0{','.join(map(str, t.shape))}\0{raw.numel()}\n".encode()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        if raw.numel():
            h.update(raw.numpy())
    return h.hexdigest()
