"""Rollout-precision emulation on CPU: FP8 (e4m3) and FP4 (e2m1, MXFP4-style block scales).

Only what the weight-delta codec and its benchmark need; no kernels.

* FP8: ``torch.float8_e4m3fn`` storage with one per-tensor scale, a power of two so that the codes
  of unchanged weights stay bit-identical when the scale is recomputed and the amax barely moves.
* FP4: OCP MX layout. Blocks of ``block`` (default 32) consecutive elements share one scale
  ``2**e`` stored as ``torch.float8_e8m0fnu`` (the biased exponent byte ``e + 127``), chosen as
  ``floor(log2(amax)) - 2`` so the block maximum lands in [4, 8) of the e2m1 grid (values above 6
  saturate to 6). Each element is a 4-bit code ``sign << 3 | magnitude index`` into
  ``(0, 0.5, 1, 1.5, 2, 3, 4, 6)``; codes are packed two per byte, **element ``2i`` in the low
  nibble** of byte ``i`` (the PTX/cuBLAS e2m1x2 order), as a ``torch.float4_e2m1fn_x2`` tensor.
  Rounding is to nearest; NaN inputs are quantized as 0 and infinities saturate (emulation only).
"""

from __future__ import annotations

import torch

FP4_BLOCK = 32
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` -> (e4m3 codes shaped like ``x``, float32 scalar scale); ``x ~= codes * scale``."""
    xf = x.detach().float()
    amax = xf.abs().amax() if xf.numel() else torch.tensor(0.0)
    amax = torch.nan_to_num(amax, nan=0.0, posinf=FP8_MAX)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX))) if amax > 0 else torch.tensor(1.0)
    codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale.float()


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (codes.float() * scale).to(dtype)


def quantize_fp4(x: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (numel a multiple of ``block``, ``block`` even) -> (packed ``float4_e2m1fn_x2`` codes of
    ``numel // 2`` bytes, ``float8_e8m0fnu`` scales of ``numel // block``), both flat."""
    n = x.numel()
    if block % 2 or n % block:
        raise ValueError(f"numel {n} must be a multiple of the (even) block size {block}")
    xb = torch.nan_to_num(x.detach().float().reshape(-1, block), nan=0.0)
    amax = xb.abs().amax(dim=1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-127))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    y = xb / torch.exp2(exp)[:, None]
    mids = torch.tensor(_E2M1_MIDPOINTS)
    mag = torch.bucketize(y.abs().clamp(max=6.0), mids).to(torch.uint8)
    codes = (mag | (torch.signbit(y).to(torch.uint8) << 3)).reshape(-1)
    packed = codes[0::2] | (codes[1::2] << 4)
    scales = (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed.view(torch.float4_e2m1fn_x2), scales


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1x2 bytes -> one uint8 code (0..15) per element."""
    b = packed.reshape(-1).view(torch.uint8)
    out = torch.empty(b.numel() * 2, dtype=torch.uint8)
    out[0::2] = b & 0x0F
    out[1::2] = b >> 4
    return out


def dequantize_fp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    shape: tuple[int, ...] | torch.Size | None = None,
    block: int = FP4_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    codes = unpack_fp4_codes(packed).long()
    mag = torch.tensor(E2M1_GRID)[codes & 7]
    val = torch.where((codes & 8) != 0, -mag, mag).reshape(-1, block)
    exp = scales.reshape(-1).view(torch.uint8).float() - 127
    out = (val * torch.exp2(exp)[:, None]).reshape(-1)
    return out.reshape(shape if shape is not None else (-1,)).to(dtype)
