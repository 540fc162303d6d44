"""Streamed rollout payloads: same bits, digests and readers as the whole-state path."""

from __future__ import annotations

import pytest
import torch

from miles.sync.checksum import digest
from miles.sync.payload import deserialize_state, serialize_state
from miles.sync.precision import PRECISIONS, state_digest, to_rollout_state
from miles.sync.stream_export import (
    PayloadLayout,
    Rechunker,
    StateHasher,
    TensorSpec,
    drain,
    encode_payload,
    iter_rollout_tensors,
    rollout_specs,
)


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-like names: quantizable linears (one with cols % 32 != 0), embeddings, norms, an int buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(50, 64, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64, generator=g) * 1e-3,
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 96, generator=g),
        "model.layers.0.mlp.odd_proj.weight": torch.randn(8, 40, generator=g),  # fp4: not a multiple of 32
        "model.layers.0.input_layernorm.weight": torch.ones(64),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(64, generator=g),
        "model.norm.weight": torch.rand(64, generator=g),
        "lm_head.weight": torch.randn(50, 64, generator=g),
        "model.step_counter": torch.tensor([3, 1, 4], dtype=torch.int64),
    }


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def specs(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.of(name, t) for name, t in state.items()]


def encode(state: dict[str, torch.Tensor], precision: str, version: int = 5, order: str = "sorted") -> tuple:
    layout = PayloadLayout.plan(specs(state), precision, version)
    names = sorted(state) if order == "sorted" else list(state)
    pieces: list[bytes] = []
    summary = encode_payload(layout, ((n, state[n]) for n in names), lambda piece: pieces.append(bytes(piece)))
    return layout, b"".join(pieces), summary


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("order", ["sorted", "model"])
def test_streamed_payload_matches_whole_state(precision: str, order: str) -> None:
    state = model_state()
    layout, payload, summary = encode(state, precision, order=order)
    expected = to_rollout_state(state, precision)

    assert len(payload) == layout.size == summary.size
    assert summary.digest == digest(payload)  # what WeightStore.put records for these bytes
    assert summary.state_digest == state_digest(expected)
    got = deserialize_state(payload)
    assert list(got) == sorted(expected)  # data (and header) in byte-wise sorted name order
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert bits(got[name]) == bits(tensor), name
    assert state_digest(got) == summary.state_digest


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_single_dtype_payload_is_byte_identical_to_serialize_state(precision: str) -> None:
    state = {k: v for k, v in model_state().items() if v.is_floating_point()}
    _, payload, _ = encode(state, precision)
    assert payload == serialize_state(to_rollout_state(state, precision), 5)


def test_header_known_before_data() -> None:
    state = model_state()
    layout = PayloadLayout.plan(specs(state), "fp4_e2m1", 9)
    whole = serialize_state(to_rollout_state(state, "fp4_e2m1"), 9)
    data_bytes = len(whole) - 8 - int.from_bytes(whole[:8], "little")
    assert layout.size - len(layout.header) == data_bytes  # the header differs only in key order and padding
    assert len(layout.header) % 8 == 0
    assert [s.name for s in layout.tensors] == sorted(to_rollout_state(state, "fp4_e2m1"))


def test_rollout_specs_follow_precision() -> None:
    state = model_state()
    for precision in PRECISIONS:
        expected = to_rollout_state(state, precision)
        assert rollout_specs(specs(state), precision) == [TensorSpec.of(n, expected[n]) for n in sorted(expected)]
    with pytest.raises(ValueError, match="unknown rollout precision"):
        rollout_specs(specs(state), "int4")
    with pytest.raises(ValueError, match="qscale"):
        rollout_specs([TensorSpec("a.qscale", torch.float32, (1,))], "bfloat16")


def test_state_hasher_matches_and_needs_sorted_names() -> None:
    state = to_rollout_state(model_state(), "fp8_e4m3")
    h = StateHasher()
    for name in sorted(state):
        h.update(name, state[name])
    assert h.hexdigest() == state_digest(state)
    with pytest.raises(ValueError, match="sorted"):
        h.update("a", torch.zeros(1))


class Boom(RuntimeError):
    pass


def test_errors_drain_the_rest_of_the_export_then_raise() -> None:
    """Rank 0 must keep gathering (collectives) after a failure, or the other ranks hang."""
    state = model_state()
    layout = PayloadLayout.plan(specs(state), "bfloat16", 1)
    seen: list[str] = []

    def gathered():
        for name in sorted(state):
            seen.append(name)
            yield name, state[name]

    calls = 0

    def failing_sink(piece: memoryview) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise Boom("bus down")

    with pytest.raises(Boom):
        encode_payload(layout, gathered(), failing_sink)
    assert seen == sorted(state)

    seen.clear()
    wrong = dict(state, **{"model.norm.weight": torch.zeros(3)})  # shape differs from the plan
    with pytest.raises(ValueError, match="planned"):
        encode_payload(layout, ((n, wrong[n]) for n in sorted(wrong)), lambda piece: None)

    with pytest.raises(ValueError, match="without 1 planned"):
        encode_payload(layout, ((n, state[n]) for n in sorted(state) if n != "lm_head.weight"), lambda p: None)
    with pytest.raises(ValueError, match="not in the planned"):
        encode_payload(layout, [("extra.weight", torch.zeros(2))], lambda p: None)


def test_iter_rollout_tensors_in_layout_order() -> None:
    state = model_state()
    layout = PayloadLayout.plan(specs(state), "fp8_e4m3", 1)
    out = list(iter_rollout_tensors(layout, state.items()))
    assert [spec.name for spec, _ in out] == layout.names
    expected = to_rollout_state(state, "fp8_e4m3")
    assert all(bits(t) == bits(expected[s.name]) for s, t in out)
    assert drain(iter(range(4))) == 4


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_rechunker_emits_exact_chunks(chunk: int) -> None:
    data = bytes(range(256)) * 9
    out: list[bytes] = []
    r = Rechunker(chunk, lambda c: out.append(bytes(c)))
    pos = 0
    for size in (3, 0, 97, 900, 1, 999, 304):
        r.write(memoryview(data[pos : pos + size]))
        pos += size
    r.write(memoryview(data[pos:]))
    r.flush()
    assert b"".join(out) == data and r.emitted == len(data)
    assert all(len(c) == chunk for c in out[:-1]) and 0 < len(out[-1]) <= chunk
