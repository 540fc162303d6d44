"""Weight sync v1 over a real nats-server, on uvloop like the actors: publish, verify, stage, apply.

The engines are started, as in a rollout worker: staged weights are applied by the engine itself (at once
when idle, at the next token boundary of a running batch), so "applied" is observed as ``engine.version``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
import torch

from miles.bus.client import Bus
from miles.bus.schema import WeightsAnnounced
from miles.config import BusConfig, TinyModelConfig
from miles.engines.base import SamplingParams
from miles.engines.batch import generate_all
from miles.engines.torch_engine import TorchEngine
from miles.models import tiny
from miles.sync.follower import WeightFollower
from miles.sync.publisher import publish_weights
from miles.sync.transport.dataplane import WeightStore

from .sync_helpers import adopted, running, until


@pytest.fixture
async def bus(nats_server: str) -> AsyncIterator[Bus]:
    handle = await Bus.open(BusConfig(), nats_server, "sync", "test")
    yield handle
    await handle.close()


def _engine(seed: int, hidden: int = 32) -> TorchEngine:
    tok = tiny.build_char_tokenizer()
    model = tiny.build_tiny_model(TinyModelConfig(hidden_size=hidden, num_layers=1, num_heads=2, seed=seed), tok)
    return TorchEngine(model, tok.pad_token_id)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in _engine(seed).model.state_dict().items()}


async def test_follower_applies_verified_weights_and_never_a_corrupt_payload(bus: Bus) -> None:
    store = await WeightStore.create(bus.js, "sync")
    engine = _engine(seed=0)
    follower = WeightFollower(bus, store, engine)
    async with engine, running(follower) as stopping:
        v1 = _weights(seed=1)
        await publish_weights(bus, store, v1, 1, "bfloat16")
        assert await asyncio.wait_for(follower.wait_for(1, stopping), 20)
        await adopted(engine, 1)
        assert follower.syncs == 1 and engine.pending_version is None
        for name, tensor in engine.model.state_dict().items():
            assert torch.equal(tensor, v1[name].float()), name

        # Version 2's announcement carries a digest that does not match its payload.
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        info = await store.put(2, b"\x00" * 1024)
        bad = WeightsAnnounced(version=2, digest="0" * 32, size=info.size, chunks=info.chunks)
        await bus.publish(bus.subjects.weights, bad)
        await until(lambda: follower.checksum_failures >= 1)
        assert follower.held_version == 1 and engine.pending_version is None  # nothing was staged
        assert engine.version == 1 and follower.syncs == 1
        assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())

        # The next good version is applied as usual.
        v3 = _weights(seed=3)
        await publish_weights(bus, store, v3, 3, "bfloat16")
        assert await asyncio.wait_for(follower.wait_for(3, stopping), 20)
        await adopted(engine, 3)
        assert follower.syncs == 2
        assert all(torch.equal(t, v3[n].float()) for n, t in engine.model.state_dict().items())


async def test_late_worker_jumps_to_the_newest_version(bus: Bus) -> None:
    store = await WeightStore.create(bus.js, "sync", keep_versions=2)
    for version in range(1, 6):
        await publish_weights(bus, store, _weights(seed=version), version, "bfloat16")
    engine = _engine(seed=0)
    follower = WeightFollower(bus, store, engine)
    async with engine, running(follower) as stopping:
        assert await asyncio.wait_for(follower.wait_for(5, stopping), 20)
        await adopted(engine, 5)
        assert follower.syncs == 1 and follower.fetches == 1  # straight to the newest, nothing in between


async def test_weights_arriving_mid_generation_switch_in_at_a_token_boundary(bus: Bus) -> None:
    """The follower stages v1 then v3 while a generation runs; it switches to v3 between two tokens."""
    store = await WeightStore.create(bus.js, "sync")
    engine = _engine(seed=0)
    follower = WeightFollower(bus, store, engine)
    reached, go, shapes = threading.Event(), threading.Event(), []

    def pause_third_forward(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        shapes.append(tuple(args[0].shape))  # the input ids: every forward embeds them once
        if len(shapes) == 3:  # the prefill sampled token 0, the first step token 1: this one computes token 2
            reached.set()
            go.wait(30)

    handle = engine.model.get_input_embeddings().register_forward_pre_hook(pause_third_forward)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    async with engine, running(follower) as stopping:
        try:  # the held forward is released before the engine closes (close joins the loop thread)
            gen = asyncio.create_task(generate_all(engine, [[1, 5, 14], [1, 7]], params))
            assert await asyncio.to_thread(reached.wait, 20)
            assert shapes[0] == (2, 3)  # both requests joined one prefill: they share every token boundary
            for version in (1, 3):
                await publish_weights(bus, store, _weights(seed=version), version, "bfloat16")
                assert await asyncio.wait_for(follower.wait_for(version, stopping), 20)
            # Busy: nothing is applied while the forward runs; the newest staged version waits for the boundary.
            assert engine.version == 0 and engine.pending_version == 3 and follower.held_version == 3
            assert follower.syncs == 0
            go.set()
            gens = await asyncio.wait_for(gen, 20)
            assert all(g.weight_version == 0 and g.version_spans == [(0, 0), (3, 3)] for g in gens)
            assert engine.version == 3 and follower.syncs == 1 and follower.last_pause_s > 0
            v3 = _weights(seed=3)
            assert all(torch.equal(t, v3[n].float()) for n, t in engine.model.state_dict().items())
        finally:
            go.set()
            handle.remove()


async def test_verified_weights_that_do_not_fit_the_model_fail_loudly(bus: Bus) -> None:
    store = await WeightStore.create(bus.js, "sync")
    engine = _engine(seed=0)
    follower = WeightFollower(bus, store, engine)
    async with engine, running(follower) as stopping:
        wrong = {k: v.to(torch.bfloat16) for k, v in _engine(seed=1, hidden=64).model.state_dict().items()}
        await publish_weights(bus, store, wrong, 1, "bfloat16")
        with pytest.raises(ValueError, match="shape mismatch"):
            await asyncio.wait_for(follower.wait_for(1, stopping), 20)
        with pytest.raises(ValueError, match="shape mismatch"):  # it stays failed: the worker cannot go on
            await asyncio.wait_for(follower.wait_for(1, stopping), 20)
        assert engine.version == 0 and engine.pending_version is None and follower.syncs == 0
