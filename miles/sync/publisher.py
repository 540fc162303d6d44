"""Trainer side of weight sync: put the payload in the data plane, then announce it.

:func:`publish_weights` publishes one whole state. :class:`WeightPublisher` publishes successive whole
states held in one process in ``full``, ``delta`` or ``lora`` mode (tools and tests; the trainer streams
every mode instead, :mod:`miles.sync.sender`). In delta mode it keeps the previously published state
in memory and publishes the sparse delta against it (:func:`miles.sync.delta.encode_state_delta`)
in the delta key space (``WeightStore(kind="delta")``), except for a *full anchor* in the full key
space at version 0, every ``anchor_every`` versions, after a restart (nothing in memory), for a
version not newer than the previous one, and whenever the encoder refuses (``ValueError``: the tensor
set, a dtype or a size changed). Every delta since the newest anchor stays stored, so a worker that
does not hold the base catches up with the newest anchor plus the deltas after it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

import structlog
import torch

from miles.bus.client import KEY_TRAINER_VERSION, Bus
from miles.bus.schema import WeightsAnnounced
from miles.security.signing import payload_sha256
from miles.sync.delta import encode_state_delta
from miles.sync.modes import DeltaSchedule
from miles.sync.payload import serialize_state
from miles.sync.precision import state_digest
from miles.sync.transport.dataplane import WeightStore

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a version sits in the trainer's history (carried by its announcement): its step, the TRAJ
    stream sequences of the batch trained into it, and whether that batch is a replay after a restart."""

    step: int = 0
    consumed: list[int] = field(default_factory=list)
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class Published:
    """An announcement and its sequence in the EVENTS stream (the trainer's checkpoint records it)."""

    announcement: WeightsAnnounced
    seq: int


async def announce(bus: Bus, announcement: WeightsAnnounced) -> Published:
    ack = await bus.publish(bus.subjects.weights, announcement)
    await bus.put_int(KEY_TRAINER_VERSION, announcement.version)
    return Published(announcement, int(ack.seq))


async def publish_weights(
    bus: Bus,
    store: WeightStore,
    state: dict[str, torch.Tensor],
    version: int,
    dtype: str,
    mode: Literal["full", "lora"] = "full",
    lineage: Lineage = Lineage(),
    *,
    sha256: bool = False,
) -> Published:
    """Upload ``state`` (a whole weight set, or a LoRA adapter for ``mode="lora"``) as ``version`` and
    announce it.

    The announcement goes out only after every chunk is stored, so a worker that sees it can
    always fetch the payload (until it is purged, which falls back to the newest version).
    """
    payload, digest = await asyncio.to_thread(_serialize_with_digest, state, version)
    info = await store.put(version, payload)
    announcement = WeightsAnnounced(
        version=version,
        step=lineage.step,
        consumed=list(lineage.consumed),
        replayed=lineage.replayed,
        digest=info.digest,
        size=info.size,
        chunks=info.chunks,
        dtype=dtype,
        precision=dtype,
        mode=mode,
        state_digest=digest,
        payload_sha256=await asyncio.to_thread(payload_sha256, payload) if sha256 else "",
    )
    published = await announce(bus, announcement)
    log.info("weights_published", version=version, step=lineage.step, mode=mode, bytes=info.size, chunks=info.chunks)
    return published


def _serialize_with_digest(state: dict[str, torch.Tensor], version: int) -> tuple[bytes, str]:
    return serialize_state(state, version), state_digest(state)


def delta_keep_versions(keep_versions: int, anchor_every: int) -> int:
    """Deltas kept in the delta key space: all since the newest anchor, plus slack for readers in flight."""
    return anchor_every + keep_versions


class WeightPublisher:
    """Publishes successive versions in ``full``, ``delta`` or ``lora`` mode (one instance per trainer
    leader). ``lora`` publishes each version's adapter whole, like ``full`` (adapters are small and all
    of their values move every step: a delta would not pay)."""

    def __init__(
        self,
        bus: Bus,
        store: WeightStore,
        dtype: str,
        *,
        mode: Literal["full", "delta", "lora"] = "full",
        delta_store: WeightStore | None = None,
        anchor_every: int = 10,
        level: int = 1,
        sha256: bool = False,
    ) -> None:
        if mode == "delta" and delta_store is None:
            raise ValueError("delta mode needs a delta store (WeightStore kind='delta')")
        if anchor_every < 1:
            raise ValueError("anchor_every must be >= 1")
        self.bus = bus
        self.store = store
        self.delta_store = delta_store
        self.dtype = dtype
        self.mode = mode
        self.anchor_every = anchor_every
        self.level = level
        self.sha256 = sha256  # also announce every payload's SHA-256 (bus.payload_sha256)
        self._prev: tuple[int, dict[str, torch.Tensor]] | None = None  # last published version, its state
        self.schedule = DeltaSchedule(anchor_every)
        self.anchors = 0
        self.deltas = 0
        self.last_bytes = 0

    async def publish(self, state: dict[str, torch.Tensor], version: int, lineage: Lineage = Lineage()) -> Published:
        """Publish ``version`` (full, a delta, or a full anchor) and announce it."""
        if self.mode != "delta":
            published = await publish_weights(
                self.bus, self.store, state, version, self.dtype, self.mode, lineage, sha256=self.sha256
            )
            self.last_bytes = published.announcement.size
            return published
        state = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
        reason = self.schedule.anchor_reason(version)
        payload: bytes | None = None
        if reason is None:
            assert self._prev is not None
            base_version, base = self._prev
            try:
                payload = await asyncio.to_thread(
                    encode_state_delta, base, state, base_version, version, level=self.level
                )
            except ValueError as exc:  # tensor set, dtype or size changed: only a full payload will do
                reason = "encoder_refused"
                log.warning("weights_delta_refused", version=version, error=str(exc))
        if payload is None:
            published = await publish_weights(
                self.bus, self.store, state, version, self.dtype, lineage=lineage, sha256=self.sha256
            )
            self.anchors += 1
            log.info("weights_anchor_published", version=version, reason=reason, bytes=published.announcement.size)
        else:
            assert self.delta_store is not None and self._prev is not None
            info = await self.delta_store.put(version, payload)
            ann = WeightsAnnounced(
                version=version,
                step=lineage.step,
                consumed=list(lineage.consumed),
                replayed=lineage.replayed,
                digest=info.digest,
                size=info.size,
                chunks=info.chunks,
                mode="delta",
                base_version=self._prev[0],
                format="miles-delta",
                dtype=self.dtype,
                precision=self.dtype,
                state_digest=await asyncio.to_thread(state_digest, state),
                payload_sha256=await asyncio.to_thread(payload_sha256, payload) if self.sha256 else "",
            )
            published = await announce(self.bus, ann)
            self.deltas += 1
            log.info("weights_delta_published", version=version, base=self._prev[0], bytes=info.size)
        self.schedule.published(version, anchor=published.announcement.mode != "delta")
        self._prev = (version, state)
        self.last_bytes = published.announcement.size
        return published
