"""Block-scaled FP8 (128x128), FP8 per matrix of a stack, MXFP4 along any axis: against plain references."""

from __future__ import annotations

import math

import pytest
import torch

from miles.sync.payload import deserialize_state, serialize_state
from miles.sync.precision import SCALE_SUFFIX, from_rollout_state
from miles.sync.quant import dequantize_fp4, quantize_fp4, quantize_fp8
from miles.sync.quant_blocks import (
    dequantize_fp4_along,
    dequantize_fp8_blocks,
    dequantize_fp8_matrices,
    fp4_blocked_axis,
    quantize_fp4_along,
    quantize_fp8_blocks,
    quantize_fp8_matrices,
)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(300, 200), (3, 130, 256), (64, 64)])
def test_fp8_blocks_equal_a_per_block_reference(shape: tuple[int, ...]) -> None:
    """Each 128x128 tile (ceil-divided at the edges) is quantized like its own tensor by quantize_fp8."""
    x = _rand(*shape)
    x[..., 0, 0] = 1000.0  # an outlier only costs its own block
    codes, scales = quantize_fp8_blocks(x)
    *lead, rows, cols = shape
    assert codes.shape == x.shape and codes.dtype == torch.float8_e4m3fn
    assert scales.shape == (*lead, math.ceil(rows / 128), math.ceil(cols / 128)) and scales.dtype == torch.float32
    flat_x, flat_c = x.reshape(-1, rows, cols), codes.reshape(-1, rows, cols)
    flat_s = scales.reshape(-1, *scales.shape[-2:])
    for m in range(flat_x.shape[0]):
        for i in range(scales.shape[-2]):
            for j in range(scales.shape[-1]):
                tile = flat_x[m, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                want_codes, want_scale = quantize_fp8(tile)
                assert flat_s[m, i, j] == want_scale
                assert torch.equal(flat_c[m, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].view(torch.uint8),
                                   want_codes.view(torch.uint8))  # fmt: skip
    back = dequantize_fp8_blocks(codes, scales, torch.float32)
    assert back.shape == x.shape
    full = scales.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
    assert torch.all((back - x).abs() <= x.abs() / 16 + full * 2.0**-9)  # half an ulp (3 mantissa bits; subnormals)
    assert bool((scales.log2() == scales.log2().round()).all())  # powers of two: stable codes across versions


def test_fp8_per_matrix_of_a_stack_scales_each_expert() -> None:
    x = _rand(4, 8, 16)
    x[2] *= 100.0  # one loud expert does not coarsen the others
    codes, scales = quantize_fp8_matrices(x)
    assert scales.shape == (4,)
    for e in range(4):
        want_codes, want_scale = quantize_fp8(x[e])
        assert scales[e] == want_scale and torch.equal(codes[e].view(torch.uint8), want_codes.view(torch.uint8))
    back = dequantize_fp8_matrices(codes, scales, torch.float32)
    quiet = (back[0] - x[0]).abs().max()
    assert quiet <= x[0].abs().max() / 16 and scales[2] > 32 * scales[0]  # expert 0 kept its own fine scale
    two_d_codes, two_d_scale = quantize_fp8_matrices(x[0])
    assert two_d_scale.shape == ()  # a 2-D weight: the per-tensor layout sync has always published


def test_fp4_along_the_last_axis_is_the_flat_codec() -> None:
    x = _rand(6, 64)
    packed, scales = quantize_fp4_along(x, 1)
    ref_packed, ref_scales = quantize_fp4(x)
    assert packed.shape == (6, 32) and scales.shape == (6, 2)
    assert torch.equal(packed.reshape(-1).view(torch.uint8), ref_packed.view(torch.uint8))
    assert torch.equal(scales.reshape(-1).view(torch.uint8), ref_scales.view(torch.uint8))


def test_fp4_along_the_input_axis_of_in_out_experts() -> None:
    """GPT-OSS stores experts as (E, in, out): blocks run along axis 1, pairs stay packed along the last axis,
    and the values equal those of the (E, out, in) transpose quantized along its last axis."""
    x = _rand(3, 64, 10)  # (E, in, out)
    packed, scales = quantize_fp4_along(x, 1)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (3, 64, 5)
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (3, 2, 10)
    assert fp4_blocked_axis((3, 64, 10), tuple(scales.shape)) == 1
    back = dequantize_fp4_along(packed, scales, 1, torch.float32)
    t = x.transpose(1, 2).contiguous()
    ref = dequantize_fp4(*quantize_fp4(t), shape=t.shape, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(back, ref)
    # The safetensors F4 header counts elements along the last axis: the round trip keeps every bit.
    state = {"e.weight": packed, "e.weight" + SCALE_SUFFIX: scales}
    again = deserialize_state(serialize_state(state, 1))
    assert torch.equal(from_rollout_state(again, torch.float32)["e.weight"], back)


def test_fp4_needs_whole_blocks_and_pairs() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_fp4_along(_rand(2, 48, 4), 1)
    with pytest.raises(ValueError, match="even last dim"):
        quantize_fp4_along(_rand(2, 64, 5), 1)
    assert fp4_blocked_axis((3, 64, 10), (3, 64, 10)) is None
    assert fp4_blocked_axis((3, 64, 10), (3, 2, 5)) is None
