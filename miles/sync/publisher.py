"""Trainer side of weight sync: put the payload in the data plane, then announce it."""

from __future__ import annotations

import asyncio

import structlog
import torch

from miles.bus.client import KEY_TRAINER_VERSION, Bus
from miles.bus.dataplane import WeightStore
from miles.bus.schema import WeightsAnnounced
from miles.sync.payload import serialize_state

log = structlog.get_logger(__name__)


async def publish_weights(
    bus: Bus, store: WeightStore, state: dict[str, torch.Tensor], version: int, dtype: str
) -> WeightsAnnounced:
    """Upload ``state`` as ``version`` and announce it; returns the announcement.

    The announcement goes out only after every chunk is stored, so a worker that sees it can
    always fetch the payload (until it is purged, which falls back to the newest version).
    """
    payload = await asyncio.to_thread(serialize_state, state, version)
    info = await store.put(version, payload)
    announcement = WeightsAnnounced(
        version=version, digest=info.digest, size=info.size, chunks=info.chunks, dtype=dtype
    )
    await bus.publish(bus.subjects.weights, announcement)
    await bus.put_int(KEY_TRAINER_VERSION, version)
    log.info("weights_published", version=version, bytes=info.size, chunks=info.chunks)
    return announcement
