"""Rollout side of weight sync: follow announcements, fetch and verify in the background, swap fast.

The worker keeps generating while a new version downloads. Verified weights are handed to the
engine's pending slot (:meth:`~miles.engines.base.StagingEngine.stage_weights`); a running generation
switches to them at its next token boundary, an idle engine at once. The only generation pause is the
in-place copy of already-verified tensors. A payload whose checksum fails is never staged: the
follower logs and counts it, then fetches again after a short pause (the newest version, if a
newer one was announced meanwhile), so a chunk damaged in transit costs a retry, not a deadlock.
A worker several versions behind jumps straight to the newest version (the engine's slot never
goes backwards either). A verified payload that does not fit the model (wrong keys or shapes) is
a deployment error: it is raised from :meth:`wait_for`, failing the worker.

LoRA mode: each announcement (``mode: lora``) carries the whole adapter, fetched like a full payload;
:class:`~miles.sync.engine_weights.EngineWeights` merges it onto the frozen base and the engine takes
the adapted modules only (a partial update).

Delta mode (docs/weight-sync.md). The follower keeps the rollout-precision state it last staged (CPU,
the exact bits of the payload: the engine may compute in float32, the base is the bf16 state, not
the model). On a ``mode: delta`` announcement whose ``base_version`` is that state's version it
fetches only the delta and reconstructs the new state off the generation path
(:func:`~miles.sync.delta.apply_state_delta` checks every tensor's base and result digests); the
pause is still only the engine's in-place copy. Otherwise (another version held, delta purged or
damaged, any :class:`~miles.sync.delta.DeltaError`) it counts a ``delta_fallback`` and catches up:
from the kept state if it is at least the newest full anchor, else from that anchor, applying the
stored deltas after it in order, as far as they verify. A wrong tensor is never staged; a broken
chain leaves the worker at the newest version it could verify until the next anchor.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass

import structlog
import torch

from miles.bus.client import Bus
from miles.bus.errors import BusError, ChecksumMismatch, PayloadMissing
from miles.bus.follow import follow
from miles.bus.schema import WeightsAnnounced
from miles.engines.base import StagingEngine
from miles.security.signing import SignatureError, verify_payload
from miles.sync.delta import DeltaError, apply_state_delta
from miles.sync.engine_weights import EngineWeights
from miles.sync.payload import deserialize_state
from miles.sync.precision import state_digest
from miles.sync.transport.base import PayloadSource, TransportBroken
from miles.sync.transport.dataplane import WeightStore

log = structlog.get_logger(__name__)

KEEP_ANNOUNCED = 64  # announcements remembered (their state digests vouch for what a catch-up rebuilds)


@dataclass(frozen=True, slots=True)
class HeldVersion:
    """A staged version as fetched: the digest of its published state, the announcement's mode, bytes."""

    state_digest: str
    mode: str
    fetch_bytes: int


class WeightFollower:
    """Tracks the newest announced version and stages verified weights in the engine."""

    def __init__(
        self,
        bus: Bus,
        store: WeightStore,
        engine: StagingEngine,
        *,
        delta_store: WeightStore | None = None,
        decoder: EngineWeights | None = None,
        sources: Mapping[str, PayloadSource] | None = None,
        require_payload_sha256: bool = False,
    ) -> None:
        self.bus = bus
        self.require_payload_sha256 = require_payload_sha256  # bus.payload_sha256: refuse payloads without one
        self.store = store
        self.engine = engine
        # Where payloads announced with a transport other than the bus are fetched, by its name (the shared
        # directory of 'fs', this worker's member of a 'broadcast' group, ...).
        self.sources: Mapping[str, PayloadSource] = dict(sources or {})
        # Published state -> engine weights (dequantize FP8/FP4, merge a LoRA adapter onto the frozen base).
        self.decoder = decoder or EngineWeights(dict)
        # Delta key space: given in delta mode; a reader is made on the first delta announcement otherwise.
        self.delta_store = delta_store
        self._keep_base = delta_store is not None
        self._base: tuple[int, dict[str, torch.Tensor]] | None = None  # last staged version and its exact bits
        # (version, base version, changed positions per tensor) of a delta just applied on the fast path
        self._sparse: tuple[int, int, dict[str, torch.Tensor]] | None = None
        # Newest version this follower staged in the engine: a sparse update needs the engine's weights to
        # be exactly a state we staged (not, e.g., the checkpoint it started from at the same version).
        self._last_staged: int | None = None
        self.delta_fallbacks = 0
        self.sparse_stages = 0  # delta versions staged as changed elements only
        self.last_fetch_bytes = 0  # bytes downloaded for the latest staged version
        self.fetched_bytes = 0  # all bytes downloaded
        self.fetches = 0  # versions staged from a fetch
        self._bytes = 0  # bytes downloaded by the fetch in progress
        self.latest: WeightsAnnounced | None = None
        self.announced: dict[int, WeightsAnnounced] = {}  # accepted announcements by version
        self.states_refused = 0  # reconstructed states whose digest is not the announced one: never staged
        self._changed = asyncio.Condition()
        self._error: ValueError | None = None
        self.checksum_failures = 0
        # Versions staged from a fetch: what the worker reports once its engine adopts one (WeightsHeld).
        self.staged_versions: dict[int, HeldVersion] = {}
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

    def stats(self) -> dict[str, float]:
        """Counters for the worker's heartbeat."""
        return {
            "syncs": float(self.syncs),
            "checksum_failures": float(self.checksum_failures),
            "last_pause_ms": self.last_pause_s * 1e3,
            "last_fetch_ms": self.last_fetch_s * 1e3,
            "delta_fallbacks": float(self.delta_fallbacks),
            "sparse_stages": float(self.sparse_stages),
            "last_fetch_bytes": float(self.last_fetch_bytes),
            "fetched_bytes": float(self.fetched_bytes),
            "fetches": float(self.fetches),
            "states_refused": float(self.states_refused),
        }

    async def run(self, stopping: asyncio.Event) -> None:
        """Consume announcements (starting with the newest already published) until ``stopping``.

        The fetch runs as a child task so that announcements keep being read while a payload downloads; it is
        supervised here: an error in it (other than the handled fetch failures) re-raises from this method.
        """
        s = self.bus.subjects
        fetcher: asyncio.Task[None] | None = None
        announcements = follow(self.bus.nc, self.bus.js, s.events_stream, s.weights, stopping, start="last", poll_s=0.5)
        try:
            async with contextlib.aclosing(announcements):
                async for raw in announcements:
                    if fetcher is not None and fetcher.done():
                        fetcher.result()  # re-raise: a dead fetcher must fail the worker, not stall it
                    ann = await self.bus.accept(raw, WeightsAnnounced)  # signed by the trainer, or refused
                    if ann is None or not self._is_news(ann):
                        continue
                    self.latest = ann
                    self.announced[ann.version] = ann
                    while len(self.announced) > KEEP_ANNOUNCED:
                        del self.announced[min(self.announced)]
                    async with self._changed:
                        self._changed.notify_all()
                    if fetcher is None or fetcher.done():
                        fetcher = asyncio.create_task(self._fetch_newest(), name="weights.fetch")
            if fetcher is not None and fetcher.done():
                fetcher.result()
        finally:
            if fetcher is not None and not fetcher.done():
                fetcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await fetcher

    async def _fetch_newest(self) -> None:
        """Fetch until the staged version is the newest announced one (skipping intermediate ones)."""
        while self._wants_fetch():
            ann = self.latest
            assert ann is not None
            start = time.perf_counter()
            self._bytes = 0
            if ann.mode == "delta":
                got = await self._fetch_delta(ann)
            else:
                full = await self._fetch_verified(ann)
                got = None if full is None else (full, ann.version)
            if got is not None and got[1] == self.held_version and self._keep_base:
                if self._base is None or self._base[0] < got[1]:
                    self._base = (got[1], got[0])  # the exact bits of the version held: deltas can follow
                    self.last_fetch_bytes = self._bytes
                    continue
            if got is None or got[1] <= self.held_version:
                # Never apply a bad payload; try again shortly, or at once if a newer version was announced
                # meanwhile (after an outage the version asked for has often been purged by newer ones).
                if self.latest is ann:
                    await asyncio.sleep(self.retry_s)
                continue
            state, version = got
            self.last_fetch_s = time.perf_counter() - start
            self.last_fetch_bytes = self._bytes
            self.fetches += 1
            sparse, self._sparse = self._sparse, None
            try:
                update, complete, digest = await asyncio.to_thread(self._decode, state)
                vouched = self.announced.get(version)
                if vouched is None or (vouched.state_digest and digest != vouched.state_digest):
                    # What an accepted announcement vouches for, or nothing: a payload written into the data
                    # plane by someone else (or a catch-up that ended on a version never announced) is refused.
                    self.states_refused += 1
                    log.error(
                        "weights_state_refused",
                        version=version,
                        got=digest,
                        announced=None if vouched is None else vouched.state_digest,
                    )
                    await asyncio.sleep(self.retry_s)
                    continue
                staged = False
                if sparse is not None and sparse[0] == version and sparse[1] == self._last_staged:
                    # Delta fast path: only the changed elements are written during the pause, if the
                    # engine will be exactly at the delta's base when it applies (else the whole state).
                    changed = await asyncio.to_thread(self.decoder.decode_changes, state, sparse[2])
                    if changed is not None:
                        staged = self.engine.stage_weights(changed, version, base_version=sparse[1], complete=False)
                        self.sparse_stages += int(staged)
                if not staged:
                    staged = self.engine.stage_weights(update, version, complete=complete)  # False if not newer
            except ValueError as exc:
                log.error("weights_rejected", version=version, error=str(exc))
                self._error = exc
            else:
                if staged:
                    self._last_staged = version
                    self._remember(version, HeldVersion(digest, ann.mode, self._bytes))
                if staged and self._keep_base:
                    self._base = (version, state)
            async with self._changed:
                self._changed.notify_all()
            if self._error is not None:
                return
            if version < ann.version:  # caught up part of the way only (a broken delta chain)
                await asyncio.sleep(self.retry_s)

    def _decode(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool, str]:
        """Engine weights for a published state, and the digest of the published state (worker thread)."""
        update, complete = self.decoder.decode(state)
        return update, complete, state_digest(state)

    def _remember(self, version: int, held: HeldVersion) -> None:
        self.staged_versions[version] = held
        while len(self.staged_versions) > 16:  # the engine adopts staged versions quickly; keep a few
            del self.staged_versions[min(self.staged_versions)]

    def _wants_fetch(self) -> bool:
        ann = self.latest
        if ann is None:
            return False
        if ann.version > self.held_version:
            return True
        # Delta mode: the engine already runs this version (e.g. its initial checkpoint, version 0) but the
        # follower lacks its exact payload bits, the base of the next delta: fetch the full payload once.
        held = self.held_version
        return (
            self._keep_base
            and ann.mode == "full"
            and ann.version == held
            and (self._base is None or self._base[0] < held)
        )

    def _delta_reader(self) -> WeightStore:
        if self.delta_store is None:
            self.delta_store = self.store.sibling("delta")
        self._keep_base = True
        return self.delta_store

    def _is_news(self, ann: WeightsAnnounced) -> bool:
        """A newer version, or the same version again over another transport (a broadcast group broke and the
        trainer re-sent it over the bus): both are worth fetching."""
        latest = self.latest
        if latest is None or ann.version > latest.version:
            return True
        return ann.version == latest.version and ann.transport != latest.transport and self.held_version < ann.version

    async def _full_payload(self, ann: WeightsAnnounced, check_digest: bool) -> memoryview:
        """A full payload from wherever its announcement says it is (docs/weight-sync.md, transports)."""
        digest = ann.digest if check_digest else None
        source = self.sources.get(ann.transport)
        if ann.transport == "bus":
            payload = await self._get(self.store, ann.version, digest)
            if check_digest:
                await self._check_sha256(payload, ann)
            return payload
        if source is None:
            raise PayloadMissing(
                f"weights v{ann.version} went over transport {ann.transport!r}, which this worker does not read"
            )
        payload = await source.fetch(ann.version, ann.digest, location=ann.location)
        self._bytes += payload.nbytes
        self.fetched_bytes += payload.nbytes
        await self._check_sha256(payload, ann)
        return payload

    async def _check_sha256(self, payload: memoryview, ann: WeightsAnnounced) -> None:
        """The payload's SHA-256 against the (signed) announcement's; a mismatch counts as a checksum failure."""
        if not (ann.payload_sha256 or self.require_payload_sha256):
            return
        try:
            await asyncio.to_thread(verify_payload, payload, ann.model_dump(), required=self.require_payload_sha256)
        except SignatureError as exc:
            raise ChecksumMismatch(str(exc)) from None

    async def _get(self, store: WeightStore, version: int, expected_digest: str | None = None) -> memoryview:
        payload = await store.get(version, expected_digest=expected_digest)
        self._bytes += payload.nbytes
        self.fetched_bytes += payload.nbytes
        return payload

    async def _fetch_delta(self, ann: WeightsAnnounced) -> tuple[dict[str, torch.Tensor], int] | None:
        """The state of ``ann.version`` from its delta if the base is held, else by catching up; the
        result may be an older version (as far as a verified chain reaches) or None."""
        delta_store = self._delta_reader()
        base = self._base
        if base is None or base[0] != ann.base_version:
            reason = f"base {ann.base_version} not held (holding {None if base is None else base[0]})"
        else:
            try:
                payload = await self._get(delta_store, ann.version, ann.digest)
                await self._check_sha256(payload, ann)
                state, changes = await asyncio.to_thread(
                    apply_state_delta, base[1], payload, base[0], with_changes=True
                )
                self._sparse = (ann.version, base[0], changes)
                return state, ann.version
            except ChecksumMismatch as exc:
                self.checksum_failures += 1
                reason = f"checksum: {exc}"
            except (DeltaError, BusError) as exc:  # PayloadMissing is a BusError
                reason = f"{type(exc).__name__}: {exc}"
        self.delta_fallbacks += 1
        log.warning("weights_delta_fallback", version=ann.version, base=ann.base_version, reason=reason)
        return await self._catch_up(ann)

    async def _catch_up(self, ann: WeightsAnnounced) -> tuple[dict[str, torch.Tensor], int] | None:
        """Newest full anchor <= ``ann.version`` (or the kept state, if not older) + the deltas after it."""
        assert self.delta_store is not None
        try:
            anchors = [v for v in await self.store.versions() if v <= ann.version]
            deltas = await self.delta_store.versions()
        except BusError as exc:
            log.warning("weights_catch_up_failed", version=ann.version, error=str(exc))
            return None
        starts: list[int | None] = []  # None: the kept state
        if self._base is not None and (not anchors or self._base[0] >= anchors[-1]):
            starts.append(None)
        if anchors and (self._base is None or self._base[0] < anchors[-1]):
            starts.append(anchors[-1])
        for start in starts:
            if start is None:
                assert self._base is not None
                cur_v, cur = self._base
            else:
                cur = await self._fetch_verified(
                    WeightsAnnounced(version=start, digest="", size=0, chunks=0), check_digest=False
                )
                if cur is None:
                    continue
                cur_v = start
            for v in sorted(d for d in deltas if cur_v < d <= ann.version):
                try:
                    payload = await self._get(self.delta_store, v, ann.digest if v == ann.version else None)
                    cur = await asyncio.to_thread(apply_state_delta, cur, payload, cur_v)
                    cur_v = v
                except (DeltaError, BusError) as exc:
                    if isinstance(exc, ChecksumMismatch):
                        self.checksum_failures += 1
                    log.warning(
                        "weights_delta_chain_broken", version=v, base=cur_v, error=f"{type(exc).__name__}: {exc}"
                    )
                    break
            if cur_v >= self.held_version and (self._base is None or cur_v > self._base[0]):
                log.info("weights_caught_up", version=cur_v, target=ann.version, start=start, bytes=self._bytes)
                return cur, cur_v
        return None

    async def _fetch_verified(
        self, ann: WeightsAnnounced, *, check_digest: bool = True
    ) -> dict[str, torch.Tensor] | None:
        """The payload of ``ann``, digest-verified and deserialised; None if it cannot be had intact.
        ``check_digest=False``: verified against the stored manifest's digest only (an anchor found by listing)."""
        checksum_attempts, transport_attempts = 0, 0
        while checksum_attempts < 2 and transport_attempts < 5:
            try:
                payload = await self._full_payload(ann, check_digest)
            except ChecksumMismatch as exc:
                checksum_attempts += 1
                self.checksum_failures += 1
                log.error("weights_checksum_failed", version=ann.version, attempt=checksum_attempts, error=str(exc))
                continue
            except (PayloadMissing, TransportBroken) as exc:
                # Purged (a newer one is announced), or sent to a broken weight-update group (the trainer
                # re-sends it over the bus): nothing to retry here.
                log.warning("weights_payload_missing", version=ann.version, error=str(exc))
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
