"""Scaled rollout formats over whole matrices and stacks of them (fused 3-D experts), on CPU.

:mod:`miles.sync.quant` quantizes one flat tensor; here the same codecs are laid over the axes of a weight:

* **FP8, one scale per matrix**: ``quantize_fp8`` per matrix. A 2-D weight gets a scale of shape ``()``
  (exactly :func:`~miles.sync.quant.quantize_fp8`); a fused ``(E, ., .)`` expert tensor one per expert,
  shape ``(E,)``, since each expert is its own matrix (and a single outlier expert would otherwise crush
  every other expert's codes).
* **FP8, one scale per 128x128 block** (DeepSeek-V3's released format, ``weight_scale_inv``): blocks tile
  the last two axes, ceil-divided at the edges; scales are float32 of shape ``(*lead, ceil(R/128),
  ceil(C/128))``. Square blocks, so which of the two axes is the input one does not matter. Each scale is
  a power of two (``2**ceil(log2(amax / 448))``) rather than DeepSeek's ``amax / 448``: the codes of
  weights that did not move then stay bit-identical across versions when a block's amax barely moves,
  which is what delta sync counts on. A loader that reads ``weight_scale_inv`` takes them as they are.
* **MXFP4 along the input axis** (GPT-OSS's released format for its experts): blocks of 32 consecutive
  input features share one e8m0 scale. The codes are a ``float4_e2m1fn_x2`` tensor whose elements keep the
  weight's own shape, packed two per byte along the *last* axis (what the safetensors ``F4`` shape means);
  the scales have the weight's shape with the blocked axis divided by 32, so a decoder finds the blocked
  axis from the two shapes alone. For a 2-D ``(out, in)`` weight this is exactly
  :func:`~miles.sync.quant.quantize_fp4`; for GPT-OSS's ``(E, in, out)`` experts the blocks run along axis 1.
  (Its checkpoint stores the same codes and scales transposed, as ``*_blocks`` ``(E, out, in/32, 16)`` and
  ``*_scales`` ``(E, out, in/32)``.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from miles.sync.quant import (
    E2M1_GRID,
    FP4_BLOCK,
    FP8_MAX,
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
    quantize_fp8,
    unpack_fp4_codes,
)

FP8_BLOCK = 128


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-entry power-of-two scale putting ``amax`` at or just under the e4m3 maximum (1 where amax is 0)."""
    amax = torch.nan_to_num(amax.float(), nan=0.0, posinf=FP8_MAX)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    return torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(safe / FP8_MAX))), torch.ones_like(amax))


# --------------------------------------------------------------------------- FP8 per matrix


def quantize_fp8_matrices(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` of shape ``(*lead, R, C)`` -> (e4m3 codes shaped like ``x``, float32 scales of shape ``lead``)."""
    if x.dim() == 2:
        codes, scale = quantize_fp8(x)
        return codes, scale.reshape(()).to(torch.float32)
    xf = x.detach().float()
    amax = xf.abs().amax(dim=(-2, -1)) if xf.numel() else torch.zeros(x.shape[:-2])
    scale = _pow2_scale(amax)
    codes = (xf / scale[..., None, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_fp8_matrices(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if codes.dim() == 2:
        return dequantize_fp8(codes, scales, dtype=dtype)
    return (codes.float() * scales.float()[..., None, None]).to(dtype)


# --------------------------------------------------------------------------- FP8 per 128x128 block


def fp8_block_scale_shape(shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, ...]:
    """Shape of the block scales of a ``(*lead, R, C)`` tensor."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block), math.ceil(cols / block))


def quantize_fp8_blocks(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` of shape ``(*lead, R, C)`` -> (e4m3 codes shaped like ``x``, float32 scales per ``block``-square)."""
    *lead, rows, cols = x.shape
    rb, cb = math.ceil(rows / block), math.ceil(cols / block)
    xf = x.detach().float()
    padded = F.pad(xf, (0, cb * block - cols, 0, rb * block - rows))  # zeros never raise a block's amax
    tiles = padded.reshape(*lead, rb, block, cb, block)
    scale = _pow2_scale(tiles.abs().amax(dim=(-3, -1)))  # (*lead, rb, cb)
    codes = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = codes.reshape(*lead, rb * block, cb * block)[..., :rows, :cols].contiguous()
    return codes, scale


def dequantize_fp8_blocks(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int = FP8_BLOCK
) -> torch.Tensor:
    *lead, rows, cols = codes.shape
    full = scales.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :rows, :cols]
    return (codes.float() * full).to(dtype)


# --------------------------------------------------------------------------- MXFP4 along one axis


def fp4_scale_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    out = list(shape)
    out[axis] //= FP4_BLOCK
    return tuple(out)


def fp4_blocked_axis(element_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int | None:
    """The axis whose blocks of 32 the scales cover, or None if the two shapes do not fit together."""
    if len(element_shape) != len(scale_shape):
        return None
    diff = [i for i, (e, s) in enumerate(zip(element_shape, scale_shape, strict=True)) if e != s]
    if len(diff) != 1 or element_shape[diff[0]] != FP4_BLOCK * scale_shape[diff[0]]:
        return None
    return diff[0]


def quantize_fp4_along(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``x.shape[axis] % 32 == 0``, last dim even) -> (codes: ``float4_e2m1fn_x2`` shaped like ``x`` with
    the last dim halved, pairs along the last axis; scales: ``float8_e8m0fnu`` of :func:`fp4_scale_shape`)."""
    axis = axis % x.dim()
    shape = tuple(x.shape)
    if shape[axis] % FP4_BLOCK or shape[-1] % 2:
        raise ValueError(f"fp4 needs axis {axis} a multiple of {FP4_BLOCK} and an even last dim, got {shape}")
    if axis == x.dim() - 1:  # blocks along the packed axis: the flat codec's layout as it is
        packed, scales = quantize_fp4(x.contiguous())
        return packed.reshape(*shape[:-1], shape[-1] // 2), scales.reshape(fp4_scale_shape(shape, axis))
    moved = x.movedim(axis, -1).contiguous()
    packed, scales = quantize_fp4(moved)
    codes = unpack_fp4_codes(packed).reshape(moved.shape).movedim(-1, axis)  # one uint8 code per element
    pairs = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    scales = scales.view(torch.uint8).reshape(*moved.shape[:-1], moved.shape[-1] // FP4_BLOCK).movedim(-1, axis)
    return pairs.view(torch.float4_e2m1fn_x2), scales.contiguous().view(torch.float8_e8m0fnu)


def dequantize_fp4_along(packed: torch.Tensor, scales: torch.Tensor, axis: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (*packed.shape[:-1], 2 * packed.shape[-1])
    axis = axis % len(shape)
    if axis == len(shape) - 1:
        return dequantize_fp4(packed.contiguous(), scales.contiguous(), shape, dtype=dtype)
    codes = unpack_fp4_codes(packed.contiguous()).long().reshape(shape)
    mag = torch.tensor(E2M1_GRID)[codes & 7]
    values = torch.where((codes & 8) != 0, -mag, mag)
    exp = scales.contiguous().view(torch.uint8).float() - 127
    return (values * torch.exp2(exp).repeat_interleave(FP4_BLOCK, dim=axis)).to(dtype)
