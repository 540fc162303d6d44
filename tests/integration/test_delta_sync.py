"""Weight sync in ``sync.mode: delta`` over a real nats-server: deltas, anchors, fallbacks, catch-up.

The engines are started, as in a rollout worker: they apply staged weights themselves (at once when idle),
so a version being applied is observed as ``engine.version`` reaching it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from miles.bus.client import Bus
from miles.bus.schema import WeightsAnnounced
from miles.config import BusConfig, TinyModelConfig
from miles.engines.base import SparseValues
from miles.engines.torch_engine import TorchEngine
from miles.models import tiny
from miles.sync.delta import encode_state_delta
from miles.sync.follower import WeightFollower
from miles.sync.publisher import WeightPublisher, delta_keep_versions
from miles.sync.transport.dataplane import WeightStore

from .sync_helpers import adopted, running, until


@pytest.fixture
async def bus(nats_server: str) -> AsyncIterator[Bus]:
    handle = await Bus.open(BusConfig(), nats_server, "dsync", "test")
    yield handle
    await handle.close()


def _engine(seed: int = 0) -> TorchEngine:
    tok = tiny.build_char_tokenizer()
    cfg = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, seed=seed)
    return TorchEngine(tiny.build_tiny_model(cfg, tok), tok.pad_token_id)


def _versions(count: int, frac: float = 0.02, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Version 0 and ``count - 1`` successors, each moving ``frac`` of every tensor's bf16 weights by one
    ulp (the shape of an Adam step in rollout precision: ~2% of the bit patterns change)."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.to(torch.bfloat16) for k, v in _engine(seed=1).model.state_dict().items()}
    out = [state]
    for _ in range(count - 1):
        new = {}
        for name, t in out[-1].items():
            bits = t.view(torch.int16).clone().reshape(-1)
            hit = (torch.rand(bits.numel(), generator=gen) < frac) & (t.reshape(-1) != 0)  # 0 - 1 ulp is NaN
            step = torch.where(torch.rand(bits.numel(), generator=gen) < 0.5, 1, -1).to(torch.int16)
            bits[hit] += step[hit]
            new[name] = bits.view(torch.bfloat16).reshape(t.shape)
        out.append(new)
    return out


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].contiguous().view(torch.int16), b[k].contiguous().view(torch.int16)) for k in a
    )


async def _stores(bus: Bus, anchor_every: int, keep: int = 3) -> tuple[WeightStore, WeightStore]:
    full = await WeightStore.create(bus.js, "dsync", keep_versions=keep)
    delta = await WeightStore.create(
        bus.js, "dsync", keep_versions=delta_keep_versions(keep, anchor_every), kind="delta"
    )
    return full, delta


def _assert_engine_holds(engine: TorchEngine, state: dict[str, torch.Tensor]) -> None:
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, state[name].float()), name


async def test_follower_tracks_every_delta_bit_exactly_and_downloads_little(bus: Bus) -> None:
    full_store, delta_store = await _stores(bus, anchor_every=100)
    pub = WeightPublisher(bus, full_store, "bfloat16", mode="delta", delta_store=delta_store, anchor_every=100)
    states = _versions(6)
    anns = [(await pub.publish(states[0], 0)).announcement]
    assert anns[0].mode == "full" and anns[0].base_version is None
    full_size = anns[0].size

    engine = _engine(seed=0)  # starts at version 0 (its checkpoint), without the payload's exact bits
    follower = WeightFollower(bus, full_store, engine, delta_store=delta_store)
    async with engine, running(follower) as stopping:
        await until(lambda: follower._base is not None)  # the v0 anchor is fetched as the base of v1
        for version in range(1, len(states)):
            ann = (await pub.publish(states[version], version)).announcement
            assert ann.mode == "delta" and ann.base_version == version - 1 and ann.format == "miles-delta"
            assert ann.size < 0.1 * full_size, (ann.size, full_size)
            assert await asyncio.wait_for(follower.wait_for(version, stopping), 20)
            await adopted(engine, version)
            assert follower.syncs == version  # one switch per delta (the v0 anchor was the engine's own version)
            assert follower.last_fetch_bytes == ann.size  # only the delta came over the bus
        assert follower.delta_fallbacks == 0 and follower.checksum_failures == 0
        assert follower._base is not None and follower._base[0] == 5
        assert _same_bits(follower._base[1], states[-1])
        _assert_engine_holds(engine, states[-1])


async def test_a_worker_that_staged_the_base_applies_deltas_as_changed_elements_only(bus: Bus) -> None:
    """A worker that starts with no version (as rollout workers do) stages version 0 whole, then every delta
    as SparseValues: the pause writes ~2% of the elements, and the engine still holds every bit."""
    full_store, delta_store = await _stores(bus, anchor_every=100)
    pub = WeightPublisher(bus, full_store, "bfloat16", mode="delta", delta_store=delta_store, anchor_every=100)
    states = _versions(5)
    engine = TorchEngine(_engine(seed=0).model, 0, version=-1)
    follower = WeightFollower(bus, full_store, engine, delta_store=delta_store)
    staged: list[tuple[int, bool, int]] = []  # (version, complete, elements written)
    stage = engine.stage_weights

    def spy(state, version, *, base_version=None, complete=True):  # type: ignore[no-untyped-def]
        ok = stage(state, version, base_version=base_version, complete=complete)
        if ok:
            count = sum(v.index.numel() if isinstance(v, SparseValues) else v.numel() for v in state.values())
            staged.append((version, complete, count))
        return ok

    engine.stage_weights = spy  # type: ignore[method-assign]
    total = sum(t.numel() for t in states[0].values())
    async with engine, running(follower) as stopping:
        for version, state in enumerate(states):
            await pub.publish(state, version)
            assert await asyncio.wait_for(follower.wait_for(version, stopping), 20)
            await adopted(engine, version)
            assert follower.syncs == version + 1
            _assert_engine_holds(engine, state)
    assert staged[0] == (0, True, total)
    assert [(v, c) for v, c, _ in staged[1:]] == [(v, False) for v in range(1, 5)]
    assert all(0 < count < 0.05 * total for _, _, count in staged[1:])  # ~2% of the elements
    assert follower.sparse_stages == 4 and follower.delta_fallbacks == 0


async def test_corrupt_delta_falls_back_and_never_stages_a_wrong_tensor(bus: Bus) -> None:
    full_store, delta_store = await _stores(bus, anchor_every=3)
    pub = WeightPublisher(bus, full_store, "bfloat16", mode="delta", delta_store=delta_store, anchor_every=3)
    states = _versions(8)
    await pub.publish(states[0], 0)
    engine = _engine(seed=0)
    follower = WeightFollower(bus, full_store, engine, delta_store=delta_store)
    follower.retry_s = 0.2
    async with engine, running(follower) as stopping:
        await until(lambda: follower._base is not None)
        await pub.publish(states[1], 1)
        assert await asyncio.wait_for(follower.wait_for(1, stopping), 20)
        await adopted(engine, 1)

        # Version 2's delta is garbage that passes the transport digest: the codec must catch it.
        garbage = bytearray(encode_state_delta(states[1], states[2], 1, 2))
        for i in range(len(garbage) - 2000, len(garbage), 7):  # damage the last tensor records' streams
            garbage[i] ^= 0x5A
        info = await delta_store.put(2, bytes(garbage))
        bad = WeightsAnnounced(
            version=2,
            digest=info.digest,
            size=info.size,
            chunks=info.chunks,
            mode="delta",
            base_version=1,
            format="miles-delta",
        )
        pub._prev = (2, states[2])  # the trainer moved on to version 2 as usual
        await bus.publish(bus.subjects.weights, bad)
        await until(lambda: follower.delta_fallbacks >= 1)
        await asyncio.sleep(0.5)
        assert follower.held_version == 1 and engine.pending_version is None  # nothing wrong staged
        assert engine.version == 1 and follower.syncs == 1
        _assert_engine_holds(engine, states[1])

        for version in range(3, 8):  # 3 and 6 are full anchors (anchor_every=3), the others deltas
            ann = (await pub.publish(states[version], version)).announcement
            assert ann.mode == ("full" if version % 3 == 0 else "delta")
            assert await asyncio.wait_for(follower.wait_for(version, stopping), 20)
            await adopted(engine, version)
        assert engine.version == 7 and follower.delta_fallbacks >= 1
        assert follower._base is not None and _same_bits(follower._base[1], states[7])
        _assert_engine_holds(engine, states[7])


async def test_late_worker_catches_up_from_the_anchor_then_follows_deltas(bus: Bus) -> None:
    full_store, delta_store = await _stores(bus, anchor_every=4)
    pub = WeightPublisher(bus, full_store, "bfloat16", mode="delta", delta_store=delta_store, anchor_every=4)
    states = _versions(10)
    for version in range(7):  # anchors 0 and 4, deltas 1-3 and 5-6
        await pub.publish(states[version], version)
    assert pub.anchors == 2 and pub.deltas == 5
    full_size = (await full_store.info(4)).size

    engine = _engine(seed=0)
    follower = WeightFollower(bus, full_store, engine, delta_store=delta_store)
    async with engine, running(follower) as stopping:
        assert await asyncio.wait_for(follower.wait_for(6, stopping), 20)
        await adopted(engine, 6)
        assert follower.syncs == 1 and follower.delta_fallbacks == 1  # straight to 6, nothing in between
        assert full_size < follower.last_fetch_bytes < 1.3 * full_size  # anchor 4 + deltas 5, 6
        _assert_engine_holds(engine, states[6])
        for version in range(7, 10):
            ann = (await pub.publish(states[version], version)).announcement
            assert await asyncio.wait_for(follower.wait_for(version, stopping), 20)
            await adopted(engine, version)
            assert follower.last_fetch_bytes == ann.size
        assert follower.delta_fallbacks == 1 and engine.version == 9
        assert _same_bits(follower._base[1], states[9])  # type: ignore[index]


async def test_shape_change_publishes_a_full_anchor(bus: Bus) -> None:
    full_store, delta_store = await _stores(bus, anchor_every=100)
    pub = WeightPublisher(bus, full_store, "bfloat16", mode="delta", delta_store=delta_store, anchor_every=100)
    states = _versions(2)
    await pub.publish(states[0], 0)
    changed = dict(states[1])
    name = next(iter(changed))
    changed[name] = changed[name].float()  # dtype change: the encoder refuses
    ann = (await pub.publish(changed, 1)).announcement
    assert ann.mode == "full" and pub.anchors == 2
    restarted = WeightPublisher(bus, full_store, "bfloat16", mode="delta", delta_store=delta_store)
    assert (await restarted.publish(states[1], 2)).announcement.mode == "full"  # nothing in memory after a restart


def test_old_announcements_still_decode_and_delta_fields_are_checked() -> None:
    from miles.bus.schema import decode, encode

    old = WeightsAnnounced(version=3, digest="d", size=1, chunks=1)
    body = decode(encode(old), WeightsAnnounced)
    assert body.mode == "full" and body.base_version is None
    with pytest.raises(ValueError):
        WeightsAnnounced(version=3, digest="d", size=1, chunks=1, mode="delta", format="miles-delta")
    with pytest.raises(ValueError):
        WeightsAnnounced(version=3, digest="d", size=1, chunks=1, base_version=2)
