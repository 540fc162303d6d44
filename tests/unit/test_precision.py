"""Rollout precision: published tensors, the way back, the state digest, and the safetensors round trip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.sync.payload import deserialize_state, serialize_state
from miles.sync.precision import (
    PRECISIONS,
    SCALE_SUFFIX,
    from_rollout_state,
    is_quantizable,
    is_quantized,
    state_digest,
    to_rollout_state,
)
from miles.sync.quant import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8

Q = "model.layers.0.self_attn.q_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
ODD = "model.layers.0.mlp.gate_proj.weight"  # 48 columns: fp8 yes, fp4 no (not a multiple of 32)
KEPT = (
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.0.input_layernorm.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.q_proj.bias",
)


def _state(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    return {
        "model.embed_tokens.weight": rnd(40, 64),
        Q: rnd(64, 64),
        "model.layers.0.self_attn.q_proj.bias": rnd(64),
        DOWN: rnd(64, 128),
        ODD: rnd(96, 48),
        "model.layers.0.input_layernorm.weight": 1 + rnd(64),
        "model.norm.weight": 1 + rnd(64),
        "lm_head.weight": rnd(40, 64),
        "model.rotary_emb.inv_freq_ids": torch.arange(8),  # an integer buffer: passed through
    }


def test_is_quantized() -> None:
    assert [is_quantized(p) for p in PRECISIONS] == [False, False, True, True]
    with pytest.raises(ValueError, match="unknown rollout precision 'int3'"):
        is_quantized("int3")


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_cast_precisions_are_a_cast(precision: str) -> None:
    state = _state()
    out = to_rollout_state(state, precision)
    dtype = getattr(torch, precision)
    assert set(out) == set(state)
    for name, t in state.items():
        if t.is_floating_point():
            assert out[name].dtype == dtype and torch.equal(out[name], t.to(dtype))
        else:
            assert torch.equal(out[name], t) and out[name].dtype == t.dtype


def test_fp8_layout_and_round_trip_equal_quant_py() -> None:
    state = _state()
    out = to_rollout_state(state, "fp8_e4m3")
    quantized = {Q, DOWN, ODD}
    assert set(out) == set(state) | {n + SCALE_SUFFIX for n in quantized}
    for name in quantized:
        codes, scale = quantize_fp8(state[name])
        assert out[name].dtype == torch.float8_e4m3fn and out[name].shape == state[name].shape
        assert torch.equal(out[name].view(torch.uint8), codes.view(torch.uint8))
        assert out[name + SCALE_SUFFIX].shape == () and out[name + SCALE_SUFFIX].dtype == torch.float32
        assert torch.equal(out[name + SCALE_SUFFIX], scale)
    for name in KEPT:  # everything else: bf16, untouched apart from the cast
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], state[name].to(torch.bfloat16))
    back = from_rollout_state(out, torch.float32)
    assert set(back) == set(state)
    for name in quantized:
        want = dequantize_fp8(*quantize_fp8(state[name]), dtype=torch.float32)
        assert torch.equal(back[name], want)
        assert not torch.equal(back[name], state[name])  # it really is the quantized value
    assert torch.equal(back["model.rotary_emb.inv_freq_ids"], state["model.rotary_emb.inv_freq_ids"])


def test_fp4_layout_and_round_trip_equal_quant_py() -> None:
    state = _state(dtype=torch.bfloat16)
    out = to_rollout_state(state, "fp4_e2m1")
    quantized = {Q, DOWN}
    assert set(out) == set(state) | {n + SCALE_SUFFIX for n in quantized}
    for name in quantized:
        rows, cols = state[name].shape
        packed, scales = quantize_fp4(state[name])
        assert out[name].dtype == torch.float4_e2m1fn_x2 and out[name].shape == (rows, cols // 2)
        assert out[name + SCALE_SUFFIX].dtype == torch.float8_e8m0fnu
        assert out[name + SCALE_SUFFIX].shape == (rows, cols // 32)
        assert torch.equal(out[name].reshape(-1).view(torch.uint8), packed.view(torch.uint8))
        assert torch.equal(out[name + SCALE_SUFFIX].reshape(-1).view(torch.uint8), scales.view(torch.uint8))
    assert out[ODD].dtype == torch.bfloat16 and torch.equal(out[ODD], state[ODD])  # 48 columns stay bf16
    back = from_rollout_state(out, torch.bfloat16)
    assert set(back) == set(state)
    for name in quantized:
        want = dequantize_fp4(*quantize_fp4(state[name]), shape=state[name].shape, dtype=torch.bfloat16)
        assert back[name].shape == state[name].shape and torch.equal(back[name], want)
    for name in KEPT:
        assert torch.equal(back[name], state[name])


def test_quantizable_rule() -> None:
    w = torch.zeros(4, 64)
    assert is_quantizable(Q, w, "fp8_e4m3") and is_quantizable(Q, w, "fp4_e2m1")
    assert not is_quantizable(Q, w, "bfloat16")
    assert not is_quantizable(Q, torch.zeros(4, 48), "fp4_e2m1") and is_quantizable(Q, torch.zeros(4, 48), "fp8_e4m3")
    assert not is_quantizable(Q, torch.zeros(2, 4, 64), "fp8_e4m3")  # not 2-D
    for name in KEPT:
        assert not is_quantizable(name, w, "fp8_e4m3")


@pytest.mark.parametrize("precision", ["fp8_e4m3", "fp4_e2m1"])
def test_quantization_is_deterministic(precision: str) -> None:
    a = to_rollout_state(_state(), precision)
    b = to_rollout_state(_state(), precision)
    assert state_digest(a) == state_digest(b)
    assert state_digest(a) != state_digest(to_rollout_state(_state(seed=1), precision))


def test_digest_is_stable_across_processes() -> None:
    code = (
        "import torch; from miles.sync.precision import state_digest, to_rollout_state; "
        "from tests.unit.test_precision import _state; "
        "print(state_digest(to_rollout_state(_state(), 'fp4_e2m1')))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == state_digest(to_rollout_state(_state(), "fp4_e2m1"))


def test_digest_is_sensitive_to_bits_names_dtypes_and_shapes() -> None:
    base = to_rollout_state(_state(), "fp8_e4m3")
    ref = state_digest(base)
    assert len(ref) == 32 and int(ref, 16) >= 0
    assert state_digest(dict(reversed(list(base.items())))) == ref  # insertion order does not matter

    def changed(**update: torch.Tensor) -> str:
        return state_digest({**base, **update})

    flipped = base[DOWN].clone()
    flipped.view(torch.uint8)[3, 7] ^= 1  # one bit of one fp8 code
    assert changed(**{DOWN: flipped}) != ref
    assert changed(**{Q + SCALE_SUFFIX: base[Q + SCALE_SUFFIX] * 2}) != ref
    assert changed(**{ODD: base[ODD].reshape(48, 96)}) != ref  # same bytes, other shape
    norm = "model.norm.weight"
    assert changed(**{norm: base[norm].view(torch.float16)}) != ref  # same bytes, other dtype
    renamed = dict(base)
    renamed["model.layers.0.mlp.gate_proj.weight2"] = renamed.pop(ODD)
    assert state_digest(renamed) != ref
    # Length framing: moving bytes between neighbouring tensors changes the digest.
    a = {"a": torch.tensor([1, 2], dtype=torch.uint8), "b": torch.tensor([3], dtype=torch.uint8)}
    b = {"a": torch.tensor([1], dtype=torch.uint8), "b": torch.tensor([2, 3], dtype=torch.uint8)}
    assert state_digest(a) != state_digest(b)
    # Layout-independent: a non-contiguous view hashes as its values.
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert state_digest({"t": t.t()}) == state_digest({"t": t.t().contiguous()})
    assert state_digest({}) != state_digest({"e": torch.empty(0)})


def test_clear_errors() -> None:
    out = to_rollout_state(_state(), "fp8_e4m3")
    missing = {k: v for k, v in out.items() if k != Q + SCALE_SUFFIX}
    with pytest.raises(ValueError, match=f"{Q}: fp8 codes without"):
        from_rollout_state(missing, torch.float32)
    with pytest.raises(ValueError, match=rf"{Q}: fp8 scales must be float32 of shape \(\) \(per matrix\) or \(1, 1\)"):
        from_rollout_state({**out, Q + SCALE_SUFFIX: torch.ones(2)}, torch.float32)
    with pytest.raises(ValueError, match="scale without its tensor"):
        from_rollout_state({**out, "x.weight" + SCALE_SUFFIX: torch.tensor(1.0)}, torch.float32)
    with pytest.raises(ValueError, match="model.norm.weight: has a '.qscale' but is torch.bfloat16"):
        from_rollout_state({**out, "model.norm.weight" + SCALE_SUFFIX: torch.tensor(1.0)}, torch.float32)

    fp4 = to_rollout_state(_state(), "fp4_e2m1")
    with pytest.raises(ValueError, match=f"{DOWN}: fp4 codes without"):
        from_rollout_state({k: v for k, v in fp4.items() if k != DOWN + SCALE_SUFFIX}, torch.float32)
    bad = fp4[DOWN + SCALE_SUFFIX][:, :2]
    expected = rf"{DOWN}: fp4 scales must be float8_e8m0fnu shaped like the \(64, 128\) elements"
    with pytest.raises(ValueError, match=expected):
        from_rollout_state({**fp4, DOWN + SCALE_SUFFIX: bad}, torch.float32)
    with pytest.raises(ValueError, match="unknown rollout precision"):
        to_rollout_state(_state(), "fp16")
    with pytest.raises(ValueError, match="must not contain '.qscale'"):
        to_rollout_state({"a" + SCALE_SUFFIX: torch.ones(1)}, "bfloat16")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_payload_round_trip_every_precision(precision: str) -> None:
    """The safetensors payload keeps every rollout dtype, shape and bit (F8_E4M3, F8_E8M0, F4 included)."""
    out = to_rollout_state(_state(), precision)
    payload = serialize_state(out, version=7)
    back = deserialize_state(payload)
    assert set(back) == set(out)
    for name, t in out.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
    assert state_digest(back) == state_digest(out)
    restored = from_rollout_state(back, torch.float32)
    expected = from_rollout_state(out, torch.float32)
    assert all(torch.equal(restored[k], expected[k]) for k in expected)


def test_payload_f4_header_counts_elements() -> None:
    """Readers in other languages see the logical e2m1 shape: the F4 header doubles torch's last dim."""
    import json

    packed = torch.arange(6, dtype=torch.uint8).view(torch.float4_e2m1fn_x2).reshape(2, 3)
    scales = torch.tensor([127, 130], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    payload = serialize_state({"w": packed, "s": scales}, version=1)
    header = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])
    assert header["w"]["dtype"] == "F4" and header["w"]["shape"] == [2, 6]
    assert header["s"]["dtype"] == "F8_E8M0" and header["s"]["shape"] == [2]
    back = deserialize_state(payload)
    assert back["w"].shape == (2, 3) and torch.equal(back["w"].view(torch.uint8), packed.view(torch.uint8))
    assert torch.equal(back["s"].view(torch.uint8), scales.view(torch.uint8))
    with pytest.raises(ValueError, match="0-d float4_e2m1fn_x2"):
        serialize_state({"w": torch.tensor(1, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, version=1)
