"""Weight-delta codec: bit-exact round trips in BF16 / FP8 / FP4 and refusal of damaged or misapplied deltas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles.sync.delta import (
    DeltaBaseMismatch,
    DeltaError,
    DeltaFormatError,
    apply_delta,
    apply_state_delta,
    delta_stats,
    encode_delta,
    encode_state_delta,
    read_state_header,
)
from miles.sync.quant import dequantize_fp4, quantize_fp4, quantize_fp8, unpack_fp4_codes


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _roundtrip(prev: torch.Tensor, new: torch.Tensor) -> bytes:
    payload = encode_delta(prev, new)
    out = apply_delta(prev, payload)
    assert out.dtype == new.dtype and out.shape == prev.shape
    assert _raw(out) == _raw(new)
    return payload


def _adam_step(n: int, lr: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    return w, w - lr * torch.randn(n, generator=g)


def _as(kind: str, x: torch.Tensor) -> list[torch.Tensor]:
    if kind == "bf16":
        return [x.to(torch.bfloat16)]
    if kind == "fp8":
        return [quantize_fp8(x)[0]]
    return list(quantize_fp4(x))


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp4"])
def test_adam_step_round_trip_is_small(kind):
    w0, w1 = _adam_step(1 << 16, {"bf16": 4e-7, "fp8": 3e-6, "fp4": 2e-5}[kind])
    for prev, new in zip(_as(kind, w0), _as(kind, w1)):
        payload = _roundtrip(prev, new)
        st = delta_stats(payload)
        changed = st["changed"] / st["positions"]
        if prev.dtype != torch.float8_e8m0fnu:
            assert 0.001 < changed < 0.06, changed
            assert st["index"] == "gaps"
            assert len(payload) < 0.1 * prev.numel() * prev.element_size()


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp4"])
def test_random_tensors_everything_changed(kind):
    g = torch.Generator().manual_seed(1)
    for prev, new in zip(_as(kind, torch.randn(4096, generator=g)), _as(kind, torch.randn(4096, generator=g) * 3)):
        st = delta_stats(_roundtrip(prev, new))
        assert st["changed"] > 0


@pytest.mark.parametrize("frac", [0.0, 1e-4, 0.03, 0.2, 0.6, 0.9, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int64, torch.uint8])
def test_all_densities_and_dtypes(frac, dtype):
    rng = np.random.default_rng(2)
    n = 10_001
    size = torch.empty(0, dtype=dtype).element_size()
    a = rng.integers(0, 256, n * size, dtype=np.uint8)
    b = a.copy().reshape(n, size)
    sel = rng.random(n) < frac
    b[sel] = rng.integers(0, 256, (int(sel.sum()), size), dtype=np.uint8)
    prev = torch.from_numpy(a).view(dtype)
    new = torch.from_numpy(b.reshape(-1)).view(dtype)
    _roundtrip(prev, new)


def test_index_modes_follow_density():
    prev = torch.zeros(100_000, dtype=torch.bfloat16)
    modes = {}
    for frac in (0.0, 0.01, 0.3, 0.95):
        new = prev.clone()
        new[: int(frac * prev.numel())] = 1.0
        new = new[torch.randperm(new.numel(), generator=torch.Generator().manual_seed(0))]
        modes[frac] = delta_stats(_roundtrip(prev, new))["index"]
    assert modes == {0.0: "none", 0.01: "gaps", 0.3: "gaps", 0.95: "all"}


def test_special_bit_patterns_are_distinct():
    specials = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 1e-40]
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        base = torch.tensor(specials).to(dtype)
        prev = base.repeat(64)
        new = prev.clone()
        # swap 0.0 <-> -0.0, and NaN to a NaN with another payload / sign
        nv = new.view(
            torch.uint8 if new.element_size() == 1 else torch.int16 if new.element_size() == 2 else torch.int32
        )
        nv[0::8], nv[1::8] = nv[1::8].clone(), nv[0::8].clone()
        nv[4::16] ^= 1
        nv[12::16] ^= -(1 << (8 * new.element_size() - 1)) if new.element_size() > 1 else 0x80  # flip the sign
        payload = _roundtrip(prev, new)
        assert delta_stats(payload)["changed"] > 0
    # -0.0 vs 0.0 alone is a change
    a = torch.zeros(8, dtype=torch.bfloat16)
    b = a.clone()
    b[3] = -0.0
    assert delta_stats(_roundtrip(a, b))["changed"] == 1


def test_fp4_nibbles_and_scales():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1024, generator=g)
    packed, scales = quantize_fp4(x)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.numel() == 512 and scales.numel() == 32
    y = dequantize_fp4(packed, scales, dtype=torch.float32)
    assert torch.allclose(y, x, atol=0, rtol=0.26) or (y - x).abs().max() < 0.5 * x.abs().max()
    # change exactly the high nibble of byte 5 and the low nibble of byte 9: two positions
    new = packed.view(torch.uint8).clone()
    new[5] ^= 0x30
    new[9] ^= 0x02
    new[100] ^= 0x11  # both nibbles of one byte
    new = new.view(torch.float4_e2m1fn_x2)
    st = delta_stats(_roundtrip(packed, new))
    assert st["changed"] == 4 and st["positions"] == 1024
    assert torch.equal(unpack_fp4_codes(packed)[:10], unpack_fp4_codes(packed)[:10])


def test_empty_and_unchanged():
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float4_e2m1fn_x2):
        empty = torch.empty(3, 0, dtype=dtype)
        _roundtrip(empty, empty.clone())
    prev = torch.randn(1 << 18).to(torch.bfloat16)
    payload = _roundtrip(prev, prev.clone())
    assert len(payload) < 64 and delta_stats(payload)["index"] == "none"


def test_shape_preserved_and_prev_untouched():
    prev = torch.randn(64, 33).to(torch.bfloat16)
    before = _raw(prev)
    new = (prev.float() * 1.01).to(torch.bfloat16)
    out = apply_delta(prev, encode_delta(prev, new))
    assert out.shape == (64, 33) and _raw(prev) == before


def test_encode_refuses_mismatched_tensors():
    with pytest.raises(ValueError):
        encode_delta(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        encode_delta(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float16))


def _state(seed: int, lr: float = 0.0) -> dict[str, torch.Tensor]:
    w0, w1 = _adam_step(1 << 14, 4e-7, seed)
    w = w1 if lr else w0
    fp4, scales = quantize_fp4(w)
    return {
        "a.weight": w.to(torch.bfloat16).view(128, 128),
        "b.fp8": quantize_fp8(w)[0],
        "c.fp4": fp4,
        "c.scale": scales,
    }


def test_state_round_trip_and_header():
    prev, new = _state(4), _state(4, lr=1.0)
    payload = encode_state_delta(prev, new, base_version=7, version=8)
    h = read_state_header(payload)
    assert (h["base_version"], h["version"]) == (7, 8)
    out = apply_state_delta(prev, payload, base_version=7)
    assert set(out) == set(new)
    for k in new:
        assert _raw(out[k]) == _raw(new[k]) and out[k].shape == new[k].shape


def test_state_wrong_base_version_and_contents():
    prev, new = _state(5), _state(5, lr=1.0)
    payload = encode_state_delta(prev, new, base_version=7, version=8)
    with pytest.raises(DeltaBaseMismatch):
        apply_state_delta(prev, payload, base_version=6)
    with pytest.raises(DeltaBaseMismatch):  # right version number, wrong contents
        apply_state_delta(new, payload, base_version=7)
    with pytest.raises(DeltaBaseMismatch):  # different tensor set
        apply_state_delta({k: v for k, v in prev.items() if k != "b.fp8"}, payload, base_version=7)
    with pytest.raises(ValueError):
        encode_state_delta(prev, {"x": new["a.weight"]}, 1, 2)


def test_corruption_is_always_detected():
    prev, new = _state(6), _state(6, lr=1.0)
    payload = encode_state_delta(prev, new, base_version=1, version=2)
    rng = np.random.default_rng(7)
    kinds: dict[str, int] = {}
    for _ in range(300):
        bad = bytearray(payload)
        pos = int(rng.integers(0, len(bad)))
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        try:
            out = apply_state_delta(prev, bytes(bad), base_version=1)
        except DeltaError as exc:  # base: a flip in a base digest, the version or a name
            kinds[type(exc).__name__] = kinds.get(type(exc).__name__, 0) + 1
        else:
            # a flip that changes nothing decoded (zstd padding bits, the new version's digit) may
            # pass, but only with the right tensors
            kinds["harmless"] = kinds.get("harmless", 0) + 1
            assert all(_raw(out[k]) == _raw(new[k]) for k in new), f"bit flip at byte {pos} gave a wrong tensor"
    assert kinds["DeltaChecksumMismatch"] + kinds["DeltaFormatError"] > 200, kinds
    for cut in (0, 3, 8, 20, len(payload) // 2, len(payload) - 1):
        with pytest.raises(DeltaFormatError):
            apply_state_delta(prev, payload[:cut], base_version=1)
    with pytest.raises(DeltaFormatError):
        apply_state_delta(prev, payload + b"\0", base_version=1)


def test_tensor_record_corruption_and_truncation():
    w0, w1 = _adam_step(1 << 15, 4e-7, 8)
    prev, new = w0.to(torch.bfloat16), w1.to(torch.bfloat16)
    payload = encode_delta(prev, new)
    for cut in range(0, len(payload), max(1, len(payload) // 50)):
        with pytest.raises(DeltaError):
            apply_delta(prev, payload[:cut])
    rng = np.random.default_rng(9)
    detected = 0
    for _ in range(200):
        bad = bytearray(payload)
        bad[int(rng.integers(0, len(bad)))] ^= 1 << int(rng.integers(0, 8))
        try:
            out = apply_delta(prev, bytes(bad))
        except DeltaError:
            detected += 1
        else:
            assert _raw(out) == _raw(new)
    assert detected > 190
    with pytest.raises(DeltaBaseMismatch):
        apply_delta(prev.float(), payload)


def _codes(t: torch.Tensor) -> np.ndarray:
    return (
        unpack_fp4_codes(t).numpy() if t.dtype == torch.float4_e2m1fn_x2 else t.contiguous().view(torch.uint8).numpy()
    )


def _changed_positions(prev: torch.Tensor, new: torch.Tensor) -> np.ndarray:
    if prev.dtype == torch.float4_e2m1fn_x2:
        return np.flatnonzero(_codes(prev) != _codes(new))
    size = prev.element_size()
    a = prev.contiguous().view(torch.uint8).numpy().reshape(-1, size)
    b = new.contiguous().view(torch.uint8).numpy().reshape(-1, size)
    return np.flatnonzero((a != b).any(axis=1))


def test_apply_state_delta_with_changes_lists_changed_positions():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(1 << 18, generator=g) * 0.02
    u = torch.randn(1 << 18, generator=g)
    w1, w4 = w - 4e-7 * u, w - 2e-5 * u  # ~2% of BF16 patterns, ~0.5% of FP4 codes change
    fp4, sc = quantize_fp4(w)
    fp4n, scn = quantize_fp4(w4)
    dense = torch.randn(4096, generator=g).to(torch.bfloat16)
    prev = {
        "bf16": w.to(torch.bfloat16).view(512, 512),  # gaps with magnitude classes
        "fp8": quantize_fp8(w)[0],
        "fp4": fp4,
        "fp4.scale": sc,
        "dense": dense,  # ~30% changed: still gaps
        "all": dense.clone(),  # everything changed
        "same": dense.clone(),  # nothing changed
    }
    new = {
        "bf16": w1.to(torch.bfloat16).view(512, 512),
        "fp8": quantize_fp8(w1)[0],
        "fp4": fp4n,
        "fp4.scale": scn,
        "dense": torch.where(torch.rand(4096, generator=g) < 0.3, dense * 2, dense),
        "all": dense * 3,
        "same": dense.clone(),
    }
    payload = encode_state_delta(prev, new, 3, 4)
    modes = {name: delta_stats(rec)["index"] for name, rec in _records(payload).items()}
    assert modes["dense"] == "gaps" and modes["all"] == "all" and modes["same"] == "none"
    assert delta_stats(_records(payload)["bf16"])["split"] > 0
    plain = apply_state_delta(prev, payload, 3)
    out, changes = apply_state_delta(prev, payload, 3, with_changes=True)
    assert set(changes) == set(new) == set(out)
    for name in new:
        assert _raw(out[name]) == _raw(new[name]) == _raw(plain[name])
        idx = changes[name]
        assert idx.dtype == torch.int64 and idx.dim() == 1
        assert np.array_equal(idx.numpy(), _changed_positions(prev[name], new[name])), name
    assert changes["same"].numel() == 0
    # FP4 positions are element (nibble) indices: patching the unpacked codes reproduces the new codes
    codes = _codes(prev["fp4"]).copy()
    codes[changes["fp4"].numpy()] = _codes(new["fp4"])[changes["fp4"].numpy()]
    assert np.array_equal(codes, _codes(new["fp4"]))


def _records(payload: bytes) -> dict[str, bytes]:
    h = read_state_header(payload)
    return {name: payload[h["_body"] + s : h["_body"] + s + n] for name, s, n in h["tensors"]}


def test_large_fp4_uses_rank_values_and_magnitude_classes_for_floats():
    w0, w1 = _adam_step(1 << 20, 2e-5, seed=12)
    prev, new = quantize_fp4(w0)[0], quantize_fp4(w1)[0]
    st = delta_stats(_roundtrip(prev, new))
    assert st["values"] == "rank" and st["index"] == "gaps"
    w0, w1 = _adam_step(1 << 20, 4e-7, seed=13)
    for prev, new in ((w0.to(torch.bfloat16), w1.to(torch.bfloat16)), (quantize_fp8(w0)[0], quantize_fp8(w1)[0])):
        with_classes = _roundtrip(prev, new)
        st = delta_stats(with_classes)
        assert st["split"] > 0 and len(st["classes"]) == 2
        assert sum(c["changed"] for c in st["classes"]) == st["changed"]
        plain = encode_delta(prev, new, classes=False)
        assert delta_stats(plain)["split"] == 0 and _raw(apply_delta(prev, plain)) == _raw(new)
        assert len(with_classes) < 0.9 * len(plain)


def test_escapes_clustered_changes_and_odd_layouts():
    # far-apart clusters (gap quotients escape) and multi-ulp jumps (value escapes)
    prev = torch.randn(1 << 20).to(torch.bfloat16)
    new = prev.clone()
    nv = new.view(torch.int16)
    nv[:50] += 1
    nv[500_000:500_100] -= 3
    nv[1_000_000:1_000_010] += 1000
    nv[-1] ^= 1
    st = delta_stats(_roundtrip(prev, new))
    assert st["index"] == "gaps" and st["changed"] == 161
    # sizes that are not whole 8-byte words, and a storage offset that misaligns the words
    for n in (1, 3, 7, 9, 4097):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.float4_e2m1fn_x2):
            base = torch.randint(0, 255, (n + 1,), dtype=torch.uint8)
            if dtype != torch.float4_e2m1fn_x2 and torch.empty(0, dtype=dtype).element_size() > 1:
                base = torch.randint(0, 255, ((n + 1) * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8)
            full = base.view(dtype)
            prev = full[1:]
            new = prev.clone()
            new.view(torch.uint8)[-1] ^= 0x11
            new.view(torch.uint8)[0] ^= 0x80
            _roundtrip(prev, new)


def test_digest_cache_never_yields_a_wrong_tensor():
    w0, w1 = _adam_step(1 << 16, 4e-7, seed=14)
    v0, v1 = w0.to(torch.bfloat16), w1.to(torch.bfloat16)
    v2 = (w1 - 4e-7).to(torch.bfloat16)
    encode_delta(v0, v1)  # remembers v1's digest, as the publisher's previous encode does
    _roundtrip(v1, v2)  # the cached digest is the right one
    v1.view(torch.int16)[7] += 1  # in-place through torch: the version counter moves, the cache is bypassed
    _roundtrip(v1, v2)
    encode_delta(v0, v1)
    v1.view(torch.int16).numpy()[9] += 1  # behind torch's back: the cached digest is stale
    stale = encode_delta(v1, v2)
    try:
        out = apply_delta(v1, stale)
    except DeltaError:
        pass
    else:
        assert _raw(out) == _raw(v2)
