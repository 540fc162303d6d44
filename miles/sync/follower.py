"""Rollout side of weight sync: follow announcements, fetch and verify in the background, swap fast.

The worker keeps generating while a new version downloads. Verified weights are handed to the
engine's pending slot (:meth:`~miles.engines.torch_engine.TorchEngine.stage_weights`); a running
generation switches to them at its next token boundary, an idle engine on
:meth:`WeightFollower.apply_staged` or its next generate. The only generation pause is the
in-place copy of already-verified tensors. A payload whose checksum fails is never staged: the
follower logs and counts it, then fetches again after a short pause (the newest version, if a
newer one was announced meanwhile), so a chunk damaged in transit costs a retry, not a deadlock.
A worker several versions behind jumps straight to the newest version (the engine's slot never
goes backwards either). A verified payload that does not fit the model (wrong keys or shapes) is
a deployment error: it is raised from :meth:`wait_for` / :meth:`apply_staged`, failing the worker.
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
from miles.engines.base import StagingEngine
from miles.sync.payload import deserialize_state

log = structlog.get_logger(__name__)


class WeightFollower:
    """Tracks the newest announced version and stages verified weights in the engine."""

    def __init__(self, bus: Bus, store: WeightStore, engine: StagingEngine) -> None:
        self.bus = bus
        self.store = store
        self.engine = engine
        self.latest: WeightsAnnounced | None = None
        self._changed = asyncio.Condition()
        self._error: ValueError | None = None
        self.checksum_failures = 0
        self.last_fetch_s = 0.0
        self.retry_s = 2.0

    @property
    def held_version(self) -> int:
        """Newest version the worker can generate with right now (applied or staged in the engine)."""
        pending = self.engine.pending_version
        return max(self.engine.version, -1 if pending is None else pending)

    @property
    def syncs(self) -> int:
        """Weight switches the engine applied (between batches or mid-generation)."""
        return self.engine.switches

    @property
    def last_pause_s(self) -> float:
        """Generation pause of the latest switch (the in-place copy)."""
        return self.engine.last_pause_s

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
            try:
                self.engine.stage_weights(state, ann.version)  # validates; ignored if not newer
            except ValueError as exc:
                log.error("weights_rejected", version=ann.version, error=str(exc))
                self._error = exc
            async with self._changed:
                self._changed.notify_all()
            if self._error is not None:
                return

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
        """Wait until weights of at least ``version`` are applied or staged; False if stopping first.

        Raises the ``ValueError`` of a verified payload the engine rejected (it will never fit).
        """
        async with self._changed:
            while self.held_version < version and not stopping.is_set() and self._error is None:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
        if self._error is not None:
            raise self._error
        return self.held_version >= version

    def apply_staged(self) -> bool:
        """Apply the engine's staged weights now if it is idle (a running generation does so itself at
        its next token boundary). Returns True if it switched."""
        if self._error is not None:
            raise self._error
        return self.engine.apply_pending()
