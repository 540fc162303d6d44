"""Rollout side of weight sync: follow announcements, fetch and verify in the background, swap fast.

The worker keeps generating while a new version downloads; :meth:`WeightFollower.apply_staged`
is the only part that pauses generation, and it only copies already-verified tensors into the
engine. A payload whose checksum fails is never staged: the follower logs and counts it, then
fetches again after a short pause (the newest version, if a newer one was announced meanwhile),
so a chunk damaged in transit costs a retry, not a deadlock. A worker several versions behind
jumps straight to the newest version.
"""

from __future__ import annotations

import asyncio
import time

import structlog
import torch
from nats.js.api import ConsumerConfig, DeliverPolicy

from miles.bus.client import Bus, messages_until
from miles.bus.dataplane import WeightStore
from miles.bus.errors import BusError, ChecksumMismatch, PayloadMissing
from miles.bus.schema import WeightsAnnounced
from miles.engines.base import Engine
from miles.sync.payload import deserialize_state

log = structlog.get_logger(__name__)


class WeightFollower:
    """Tracks the newest announced version and stages verified weights for the engine."""

    def __init__(self, bus: Bus, store: WeightStore, engine: Engine) -> None:
        self.bus = bus
        self.store = store
        self.engine = engine
        self.latest: WeightsAnnounced | None = None
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._changed = asyncio.Condition()
        self.checksum_failures = 0
        self.syncs = 0
        self.last_pause_s = 0.0
        self.last_fetch_s = 0.0
        self.retry_s = 2.0

    @property
    def held_version(self) -> int:
        """Newest version the worker can generate with right now (applied or staged)."""
        staged = self._staged[0] if self._staged else -1
        return max(self.engine.version, staged)

    async def run(self, stopping: asyncio.Event) -> None:
        """Consume announcements (starting with the newest already published) until ``stopping``."""
        config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        sub = await self.bus.js.subscribe(self.bus.subjects.weights, ordered_consumer=True, config=config)
        fetcher: asyncio.Task[None] | None = None
        try:
            async for msg in messages_until(sub, stopping):
                ann = await self.bus.decode_or_dead_letter(msg, WeightsAnnounced)
                if ann is None or (self.latest is not None and ann.version <= self.latest.version):
                    continue
                self.latest = ann
                async with self._changed:
                    self._changed.notify_all()
                if fetcher is None or fetcher.done():
                    fetcher = asyncio.create_task(self._fetch_newest(), name="weights.fetch")
        finally:
            if fetcher is not None:
                fetcher.cancel()

    async def _fetch_newest(self) -> None:
        """Fetch until the staged version is the newest announced one (skipping intermediate ones)."""
        while self.latest is not None and self.latest.version > self.held_version:
            ann = self.latest
            start = time.perf_counter()
            state = await self._fetch_verified(ann)
            if state is None:
                # Never apply a bad payload; try again shortly (or a newer version, if one was announced).
                await asyncio.sleep(self.retry_s)
                continue
            self.last_fetch_s = time.perf_counter() - start
            self._staged = (ann.version, state)
            async with self._changed:
                self._changed.notify_all()

    async def _fetch_verified(self, ann: WeightsAnnounced) -> dict[str, torch.Tensor] | None:
        """The payload of ``ann``, digest-verified and deserialised; None if it cannot be had intact."""
        checksum_attempts, transport_attempts = 0, 0
        while checksum_attempts < 2 and transport_attempts < 5:
            try:
                payload = await self.store.get(ann.version, expected_digest=ann.digest)
            except ChecksumMismatch as exc:
                checksum_attempts += 1
                self.checksum_failures += 1
                log.error("weights_checksum_failed", version=ann.version, attempt=checksum_attempts, error=str(exc))
                continue
            except PayloadMissing:
                log.warning("weights_payload_missing", version=ann.version)  # purged: a newer one is announced
                return None
            except BusError as exc:  # connection trouble is transient: back off and try again
                transport_attempts += 1
                log.warning("weights_fetch_failed", version=ann.version, attempt=transport_attempts, error=str(exc))
                await asyncio.sleep(min(2.0**transport_attempts, 10.0))
                continue
            return await asyncio.to_thread(deserialize_state, payload)
        return None

    async def wait_for(self, version: int, stopping: asyncio.Event) -> bool:
        """Wait until weights of at least ``version`` are applied or staged; False if stopping first."""
        async with self._changed:
            while self.held_version < version and not stopping.is_set():
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
        return self.held_version >= version

    def apply_staged(self) -> bool:
        """Swap staged weights into the engine (the generation pause). Returns True if it swapped."""
        staged, self._staged = self._staged, None
        if staged is None or staged[0] <= self.engine.version:
            return False
        version, state = staged
        start = time.perf_counter()
        self.engine.load_weights(state, version)
        self.last_pause_s = time.perf_counter() - start
        self.syncs += 1
        log.info("weights_applied", version=version, pause_ms=round(self.last_pause_s * 1e3, 2))
        return True
