"""Weight sync v1 over a real nats-server, on uvloop like the actors: publish, verify, stage, apply."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from miles.bus.client import Bus
from miles.bus.dataplane import WeightStore
from miles.bus.schema import WeightsAnnounced
from miles.config import BusConfig, TinyModelConfig
from miles.engines.torch_engine import TorchEngine
from miles.models import tiny
from miles.sync.follower import WeightFollower
from miles.sync.publisher import publish_weights


@pytest.fixture
async def bus(nats_server: str) -> AsyncIterator[Bus]:
    handle = await Bus.open(BusConfig(), nats_server, "sync", "test")
    yield handle
    await handle.close()


def _engine(seed: int) -> TorchEngine:
    tok = tiny.build_char_tokenizer()
    model = tiny.build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, seed=seed), tok)
    return TorchEngine(model, tok.pad_token_id)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in _engine(seed).model.state_dict().items()}


async def _until(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_follower_applies_verified_weights_and_never_a_corrupt_payload(bus: Bus) -> None:
    store = await WeightStore.create(bus.js, "sync")
    engine = _engine(seed=0)
    follower = WeightFollower(bus, store, engine)
    stopping = asyncio.Event()
    task = asyncio.create_task(follower.run(stopping))
    try:
        v1 = _weights(seed=1)
        await publish_weights(bus, store, v1, 1, "bfloat16")
        assert await asyncio.wait_for(follower.wait_for(1, stopping), 20)
        assert follower.apply_staged()
        assert engine.version == 1
        for name, tensor in engine.model.state_dict().items():
            assert torch.equal(tensor, v1[name].float()), name

        # Version 2's announcement carries a digest that does not match its payload.
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        info = await store.put(2, b"\x00" * 1024)
        bad = WeightsAnnounced(version=2, digest="0" * 32, size=info.size, chunks=info.chunks)
        await bus.publish(bus.subjects.weights, bad)
        await _until(lambda: follower.checksum_failures >= 1)
        assert not follower.apply_staged()
        assert engine.version == 1
        assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())

        # The next good version is applied as usual.
        v3 = _weights(seed=3)
        await publish_weights(bus, store, v3, 3, "bfloat16")
        assert await asyncio.wait_for(follower.wait_for(3, stopping), 20)
        follower.apply_staged()
        assert engine.version == 3
    finally:
        stopping.set()
        await task


async def test_late_worker_jumps_to_the_newest_version(bus: Bus) -> None:
    store = await WeightStore.create(bus.js, "sync", keep_versions=2)
    for version in range(1, 6):
        await publish_weights(bus, store, _weights(seed=version), version, "bfloat16")
    engine = _engine(seed=0)
    follower = WeightFollower(bus, store, engine)
    stopping = asyncio.Event()
    task = asyncio.create_task(follower.run(stopping))
    try:
        assert await asyncio.wait_for(follower.wait_for(5, stopping), 20)
        follower.apply_staged()
        assert engine.version == 5 and follower.syncs == 1  # straight to the newest, nothing in between
    finally:
        stopping.set()
        await task
