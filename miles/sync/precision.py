"""Rollout precision: the exact tensors the trainer publishes, and the way back to a model state dict.

Rollout must see the *same* quantized weights as the trainer evaluates and audits, so quantization
happens once, on the trainer, with the deterministic CPU codecs of :mod:`miles.sync.quant` and
:mod:`miles.sync.quant_blocks`; workers only dequantize. Published names (``sync.dtype``):

* ``bfloat16`` / ``float32``: every floating tensor cast, same names.
* ``fp8_e4m3``: each quantizable tensor ``name`` -> e4m3 codes (same shape) plus ``name + ".qscale"``
  -> float32 scales: one per matrix (shape ``()`` for a 2-D weight, ``(E,)`` for fused experts), or, where
  the model family's native format is block-scaled FP8 (DeepSeek-V3.2, GLM-5.2, Qwen3.8), one per
  128x128 block (shape ``(*lead, ceil(R/128), ceil(C/128))``); everything else bfloat16.
* ``fp4_e2m1``: each quantizable tensor ``name`` -> ``float4_e2m1fn_x2`` codes (the weight's shape, last
  dim halved: pairs along the last axis) plus ``name + ".qscale"`` -> ``float8_e8m0fnu`` scales per 32
  input features (the weight's shape with the input axis divided by 32); everything else bfloat16. For
  GPT-OSS's experts this is the released MXFP4 format.

Which tensors quantize: without a family (``model.type`` tiny or pretrained), a 2-D ``.weight`` of a
decoder linear layer, i.e. no ``embed``, ``lm_head`` or ``norm`` in the name. With one, exactly what the
family's rule says (:func:`miles.models.families.rules.quantizable`): its linear layers and its fused 3-D
expert tensors, never routers, gates, sinks, embeddings or norms. For fp4 the input axis must also be a
whole number of 32-blocks (and the last dim even). Decoding needs no family: the scale shapes say the format.

:func:`state_digest` fingerprints such a state (names, dtypes, shapes, bits): the trainer announces it
and workers report the digest of what they hold, so the controller can flag any divergence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import xxhash

from miles.sync.quant import FP4_BLOCK
from miles.sync.quant_blocks import (
    FP8_BLOCK,
    dequantize_fp4_along,
    dequantize_fp8_blocks,
    dequantize_fp8_matrices,
    fp4_blocked_axis,
    fp4_scale_shape,
    fp8_block_scale_shape,
    quantize_fp4_along,
    quantize_fp8_blocks,
    quantize_fp8_matrices,
)

if TYPE_CHECKING:
    from miles.models.families.base import ModelFamily

SCALE_SUFFIX = ".qscale"
PRECISIONS: tuple[str, ...] = ("bfloat16", "float32", "fp8_e4m3", "fp4_e2m1")
_CAST: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_QUANTIZED = ("fp8_e4m3", "fp4_e2m1")
_EXCLUDED = ("embed", "lm_head", "norm")


@dataclass(frozen=True, slots=True)
class Encoding:
    """How one tensor is published: ``fp8_matrix`` (a scale per matrix), ``fp8_block`` (per 128x128 block) or
    ``fp4`` (e8m0 per 32 elements along ``axis``, the input axis)."""

    kind: Literal["fp8_matrix", "fp8_block", "fp4"]
    axis: int = -1

    def specs(
        self, shape: tuple[int, ...]
    ) -> tuple[tuple[torch.dtype, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]:
        """``((codes dtype, shape), (scales dtype, shape))`` for a tensor of ``shape``."""
        if self.kind == "fp8_matrix":
            return (torch.float8_e4m3fn, shape), (torch.float32, shape[:-2])
        if self.kind == "fp8_block":
            return (torch.float8_e4m3fn, shape), (torch.float32, fp8_block_scale_shape(shape))
        codes = (*shape[:-1], shape[-1] // 2)
        return (torch.float4_e2m1fn_x2, codes), (torch.float8_e8m0fnu, fp4_scale_shape(shape, self.axis))


def is_quantized(precision: str) -> bool:
    """True for the precisions that publish codes plus ``.qscale`` scales."""
    _check_precision(precision)
    return precision in _QUANTIZED


def _resolve(family: ModelFamily | str | None) -> ModelFamily | None:
    if family is None or not isinstance(family, str):
        return family
    from miles.models.families.registry import get_family

    return get_family(family)


def encoding(
    name: str, tensor: torch.Tensor, precision: str, family: ModelFamily | str | None = None
) -> Encoding | None:
    """How ``to_rollout_state`` publishes this tensor at ``precision`` under ``family``'s rule; None: cast only.
    ``tensor`` may be on the meta device (only its shape and dtype are read)."""
    if not is_quantized(precision) or not tensor.is_floating_point() or tensor.dim() < 2 or tensor.numel() == 0:
        return None
    fam = _resolve(family)
    if fam is None:
        if tensor.dim() != 2 or not name.endswith(".weight") or any(word in name for word in _EXCLUDED):
            return None
        in_axis, native_block = 1, None
    else:
        from miles.models.families.rules import quantizable

        target = quantizable(name, tensor, fam)
        if target is None:
            return None
        fmt = target.format
        in_axis = target.in_axis
        native_block = fmt.block if fmt.codes == "float8_e4m3fn" and not fmt.per_tensor else None
    if precision == "fp8_e4m3":
        if native_block is None:
            return Encoding("fp8_matrix")
        if native_block != (FP8_BLOCK, FP8_BLOCK):
            raise ValueError(
                f"{name}: block-scaled FP8 is implemented for {FP8_BLOCK}x{FP8_BLOCK} blocks, not {native_block}"
            )
        return Encoding("fp8_block")
    if tensor.shape[in_axis] % FP4_BLOCK or tensor.shape[-1] % 2:
        return None
    return Encoding("fp4", in_axis)


def is_quantizable(name: str, tensor: torch.Tensor, precision: str, family: ModelFamily | str | None = None) -> bool:
    """Whether ``to_rollout_state`` quantizes this tensor at ``precision`` (under ``family``'s rule, if given)."""
    return encoding(name, tensor, precision, family) is not None


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown rollout precision {precision!r} (expected one of {', '.join(PRECISIONS)})")


def to_rollout_state(
    state: dict[str, torch.Tensor], precision: str, family: ModelFamily | str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors published for ``state`` (HF names, any float dtype) at ``precision``; ``family`` (a model
    family or its name) picks which tensors quantize and in which format, None the generic rule.

    Deterministic: the same input gives the same bits, on any machine. Quantized tensors (and their
    scales) are computed on CPU, because the codec is a CPU emulation and CPU float ops are the ones
    we can vouch for bit-for-bit; cast-only tensors keep their device. Non-floating tensors (integer
    buffers) are passed through unchanged.
    """
    _check_precision(precision)
    fam = _resolve(family)
    for name in state:
        if name.endswith(SCALE_SUFFIX):
            raise ValueError(f"{name}: a model state dict must not contain '{SCALE_SUFFIX}' names")
    out: dict[str, torch.Tensor] = {}
    cast = _CAST.get(precision, torch.bfloat16)  # quantized modes: everything not quantized is bf16
    for name, tensor in state.items():
        t = tensor.detach()
        how = encoding(name, t, precision, fam)
        if how is not None:
            t = t.to("cpu")
            if how.kind == "fp8_matrix":
                codes, scales = quantize_fp8_matrices(t)
            elif how.kind == "fp8_block":
                codes, scales = quantize_fp8_blocks(t)
            else:
                codes, scales = quantize_fp4_along(t, how.axis)
            out[name] = codes
            out[name + SCALE_SUFFIX] = scales
        elif t.is_floating_point():
            out[name] = t.to(cast)
        else:
            out[name] = t
    return out


def from_rollout_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A published state back to a model state dict (HF names, no ``.qscale``) in ``dtype``.

    Codes are dequantized with their scales, whose shape says the format (per matrix, per 128x128 block,
    per 32 along an axis). A missing, orphaned or ill-shaped scale raises ``ValueError`` naming the tensor:
    applying codes with a wrong scale would silently give the worker different weights from the trainer's.
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
    shape = tuple(codes.shape)
    per_matrix, blocks = shape[:-2], fp8_block_scale_shape(shape) if codes.dim() >= 2 else None
    if codes.dim() < 2 or scale.dtype != torch.float32 or tuple(scale.shape) not in (per_matrix, blocks):
        raise ValueError(
            f"{name}: fp8 scales must be float32 of shape {per_matrix} (per matrix) or {blocks} (per "
            f"{FP8_BLOCK}x{FP8_BLOCK} block) for codes {shape}, got {scale.dtype} {tuple(scale.shape)}"
        )
    codes, scale = codes.to("cpu"), scale.to("cpu")
    if tuple(scale.shape) == per_matrix:  # ndim - 2 axes: per matrix; ndim axes: per block (never equal)
        return dequantize_fp8_matrices(codes, scale, dtype)
    return dequantize_fp8_blocks(codes, scale, dtype)


def _dequantize_fp4(name: str, packed: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scales is None:
        raise ValueError(f"{name}: fp4 codes without a '{name}{SCALE_SUFFIX}' scale")
    elements = (*packed.shape[:-1], 2 * packed.shape[-1]) if packed.dim() else ()
    axis = fp4_blocked_axis(elements, tuple(scales.shape)) if packed.dim() >= 2 else None
    if scales.dtype != torch.float8_e8m0fnu or axis is None:
        raise ValueError(
            f"{name}: fp4 scales must be float8_e8m0fnu shaped like the {elements} elements with one axis divided "
            f"by {FP4_BLOCK}, got {scales.dtype} {tuple(scales.shape)}"
        )
    return dequantize_fp4_along(packed.to("cpu"), scales.to("cpu"), axis, dtype)


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
