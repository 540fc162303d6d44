"""The trainer's side of weight sync: one object that turns the trained weights into a published version.

:func:`build_sender` opens the data-plane stores, the mode ``sync.mode`` names (:mod:`miles.sync.modes`) and,
once the trainer knows whether this is the run's first start, the payload transport that ``sync.transport``
names. The trainer then calls :meth:`WeightSender.publish` and nothing else of sync. Modes and transports are
registered by name (:func:`~miles.sync.modes.register_sync_mode`, :func:`register_transport`), so a new one is
a factory, not a branch in the trainer.

Every mode streams one tensor at a time and no rank holds the whole state. The sender's primitives, which a
mode combines:

* :meth:`WeightSender.stream`: the export (or the adapter only) into the transport as it is gathered.
* :meth:`WeightSender.owned_delta`: each tensor's previous bits live on the trainer rank that owns it, which
  encodes its delta record (:mod:`miles.sync.owned_delta`); rank 0 writes the records into the delta store as
  they come.
* :meth:`WeightSender.owned_anchor`: a full payload into the full store from the same owned export (it
  refreshes every owner's previous bits).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import xxhash

from miles.bus.errors import BusError
from miles.bus.schema import WeightsAnnounced
from miles.models.families.registry import family_of
from miles.plugins import Registry
from miles.sync.delta import framed_record, state_delta_header
from miles.sync.modes import SyncMode, sync_mode
from miles.sync.owned_delta import OwnedTensor
from miles.sync.publisher import Lineage, Published, announce, delta_keep_versions
from miles.sync.stream_export import (
    ExportSummary,
    PayloadLayout,
    Sink,
    StateHasher,
    drain,
    rollout_specs,
    write_payload,
)
from miles.sync.transport.base import WeightTransport
from miles.sync.transport.broadcast import BroadcastTransport, join_run_group
from miles.sync.transport.bus import BusTransport, stored, write_streamed
from miles.sync.transport.dataplane import WeightStore
from miles.sync.transport.fallback import FallbackTransport
from miles.sync.transport.fs import FsTransport, fs_root

if TYPE_CHECKING:
    from miles.actors.trainer_ranks import LeaderRanks
    from miles.bus.client import Bus
    from miles.config import RunConfig


@dataclass(frozen=True, slots=True)
class TransportContext:
    """What a transport factory may use: the run's config and directory, the bus store (every transport
    falls back to it), and whether this is the run's first start (a weight-update group forms only then)."""

    cfg: RunConfig
    run_dir: Path
    store: WeightStore
    first_start: bool
    log: Any


# factory(TransportContext)
TRANSPORTS: Registry[Awaitable[WeightTransport]] = Registry("weight transport", by_path=False)
register_transport = TRANSPORTS.register  # the trainer side of ``sync.transport: <name>``


@register_transport("bus")
async def _bus(ctx: TransportContext) -> WeightTransport:
    return BusTransport(ctx.store)


@register_transport("fs")
async def _fs(ctx: TransportContext) -> WeightTransport:
    return FsTransport(fs_root(ctx.cfg, ctx.run_dir), keep_versions=ctx.cfg.sync.keep_versions)


@register_transport("broadcast")
async def _broadcast(ctx: TransportContext) -> WeightTransport:
    """A weight-update group of the trainer (rank 0) and every worker. It forms once, at the run's first start
    (every worker joins then); a restarted trainer cannot re-form it with running workers and uses the bus."""
    sync, bus = ctx.cfg.sync, BusTransport(ctx.store)
    if not ctx.first_start:
        ctx.log.warning("weight_group_not_reformed", reason="trainer restart: weights go over the bus")
        return bus
    group = await asyncio.to_thread(join_run_group, ctx.cfg, 0)
    return FallbackTransport(BroadcastTransport(group, bucket_bytes=sync.broadcast_bucket_mb * 2**20), bus)


class WeightSender:
    """Publishes the trainer's weights as versions: stores, transport, precision and announcement in one place."""

    def __init__(
        self,
        cfg: RunConfig,
        bus: Bus,
        ranks: LeaderRanks,
        run_dir: Path,
        store: WeightStore,
        delta_store: WeightStore | None,
        log: Any,
    ) -> None:
        self.cfg = cfg
        self.bus = bus
        self.ranks = ranks
        self.run_dir = run_dir
        self.store = store
        self.delta_store = delta_store
        self.log = log
        self.transport: WeightTransport = BusTransport(store)
        self.mode: SyncMode = sync_mode(cfg)  # what each version carries (a fresh one: a restart anchors first)

    async def connect(self, *, first_start: bool) -> None:
        """Open the full-mode payload transport of ``sync.transport`` (registered in :data:`TRANSPORTS`)."""
        factory = TRANSPORTS.factory(self.cfg.sync.transport)
        self.transport = await factory(TransportContext(self.cfg, self.run_dir, self.store, first_start, self.log))

    async def stored_versions(self) -> list[int]:
        """The newest version each data-plane store holds (a restart numbers on past them)."""
        stores = [self.store] + ([self.delta_store] if self.delta_store is not None else [])
        newest = [await s.latest() for s in stores]
        return [v for v in newest if v is not None]

    async def publish(self, version: int, lineage: Lineage) -> Published:
        """Export the current weights and publish (and announce) them as ``version``, as the mode says."""
        return await self.mode.publish(self, version, lineage)

    async def _announce(self, fields: dict[str, Any], lineage: Lineage, **extra: Any) -> Published:
        """The one place a version's announcement is built: the payload's facts (``fields``), where it sits in
        the trainer's history, and the mode's own fields (``mode``, ``transport``, ``base_version``, ...)."""
        sync = self.cfg.sync
        announcement = WeightsAnnounced(
            **fields,
            step=lineage.step,
            consumed=list(lineage.consumed),
            replayed=lineage.replayed,
            dtype=sync.dtype,
            precision=sync.dtype,
            **extra,
        )
        published = await announce(self.bus, announcement)
        self.log.info(
            "weights_published",
            version=announcement.version,
            step=lineage.step,
            mode=announcement.mode,
            bytes=announcement.size,
            chunks=announcement.chunks,
        )
        return published

    async def stream(
        self, version: int, lineage: Lineage, *, adapter_only: bool, mode: Literal["full", "lora"]
    ) -> Published:
        """The weights (or only the adapter) streamed into the transport one tensor at a time, announced as
        payload ``mode`` (``full`` or ``lora``). An adapter is published in bf16 where the sync dtype quantizes
        (FP8/FP4 codes are for base weights)."""
        from miles.sync.precision import is_quantized

        sync = self.cfg.sync
        precision = "bfloat16" if adapter_only and is_quantized(sync.dtype) else sync.dtype
        specs = self.ranks.worker.backend.export_specs(adapter_only=adapter_only)
        layout = PayloadLayout.plan(specs, precision, version, self._family, sha256=self.cfg.bus.payload_sha256)
        out = await self.transport.publish(layout, lambda: self.ranks.export_stream(adapter_only), run=self.ranks.run)
        location = Path(out.location).name if out.transport == "fs" else out.location
        return await self._announce(
            out.announcement_fields(), lineage, mode=mode, transport=out.transport, location=location
        )

    @property
    def _family(self) -> str | None:
        return family_of(self.cfg.model)  # its quantization rule picks what FP8/FP4 quantize

    async def owned_anchor(self, version: int, lineage: Lineage) -> Published:
        """A full payload of the owned export (every owner refreshes its previous bits) into the full store."""
        layout = PayloadLayout.plan(
            self.ranks.worker.backend.export_specs(),
            self.cfg.sync.dtype,
            version,
            self._family,
            sha256=self.cfg.bus.payload_sha256,
        )

        def produce(sink: Sink) -> ExportSummary:
            stream = self.ranks.owned_export_stream(True)
            try:
                ordered = in_order(layout.names, stream)
                return write_payload(layout, ((item.spec, item.tensor) for item in ordered), sink)
            except Exception:
                drain(stream)  # the other ranks are still exchanging: finish with them
                raise

        info, summary = await write_streamed(self.store, version, layout.size, produce, self.ranks.run)
        if info.digest != summary.digest or info.size != summary.size:
            raise BusError(f"weights v{version}: the store recorded {info}, the encoder {summary}")
        out = stored(info, summary.state_digest, summary.payload_sha256)
        return await self._announce(out.announcement_fields(), lineage, mode="full")

    async def owned_delta(self, version: int, lineage: Lineage, *, base_version: int) -> Published | None:
        """The delta against ``base_version`` (the previous version this process published), written record by
        record as the owners encode them; None if an owner could not encode one (no previous bits, or a tensor
        whose dtype or size changed): publish an anchor instead."""
        if self.delta_store is None:
            raise ValueError(f"sync.mode {self.cfg.sync.mode!r}: a delta needs the delta store (uses_delta_store)")
        specs = rollout_specs(self.ranks.worker.backend.export_specs(), self.cfg.sync.dtype, self._family)
        names = [spec.name for spec in specs]  # the payload's order: sorted, as the state digest hashes

        def produce(sink: Sink) -> DeltaSummary:
            stream = self.ranks.owned_export_stream(False)
            summary = DeltaSummary(sha256=self.cfg.bus.payload_sha256)
            try:
                summary.emit(sink, state_delta_header(base_version, version, names))
                for item in in_order(names, stream):
                    if not item.record:  # an owner could not encode it: this version goes out as an anchor
                        drain(stream)
                        raise DeltaRefused(item.spec.name)
                    summary.hasher.update(item.spec.name, item.tensor)
                    summary.emit(sink, framed_record(item.record))
            except Exception:
                drain(stream)
                raise
            return summary

        try:
            info, summary = await write_streamed(self.delta_store, version, None, produce, self.ranks.run)
        except DeltaRefused as exc:
            self.log.warning("weights_delta_refused", version=version, tensor=str(exc))
            return None
        if info.digest != summary.digest:
            raise BusError(f"weights v{version}: the store recorded {info.digest}, the encoder {summary.digest}")
        out = stored(info, summary.hasher.hexdigest(), summary.sha256_hex)
        fields = out.announcement_fields()
        return await self._announce(fields, lineage, mode="delta", base_version=base_version, format="miles-delta")


class DeltaRefused(Exception):
    """An owner could not encode a tensor's delta (its name is the message): the version goes out as an anchor."""


class DeltaSummary:
    """The delta payload's running digests as rank 0 writes it: the payload's xxh3-128 (what the store
    records), optionally its SHA-256, and the state digest of the new tensors."""

    def __init__(self, *, sha256: bool) -> None:
        self._payload = xxhash.xxh3_128()
        self._sha256 = hashlib.sha256() if sha256 else None
        self.hasher = StateHasher()

    def emit(self, sink: Sink, piece: bytes) -> None:
        view = memoryview(piece)
        self._payload.update(view)
        if self._sha256 is not None:
            self._sha256.update(view)
        sink(view)

    @property
    def digest(self) -> str:
        return self._payload.hexdigest()

    @property
    def sha256_hex(self) -> str:
        return self._sha256.hexdigest() if self._sha256 is not None else ""


def in_order(names: list[str], items: Iterable[OwnedTensor]) -> Iterator[OwnedTensor]:
    """``items`` in the order of ``names`` (the payload's): an item that comes early waits until its turn
    (the export comes in sorted order already, so normally none waits)."""
    position = {name: i for i, name in enumerate(names)}
    pending: dict[int, OwnedTensor] = {}
    turn = 0
    for item in items:
        index = position.get(item.spec.name)
        if index is None or index < turn or index in pending:
            raise ValueError(f"{item.spec.name}: not expected here in the payload")
        pending[index] = item
        while turn in pending:
            yield pending.pop(turn)
            turn += 1
    if turn != len(names):
        raise ValueError(f"the export ended without {names[turn]!r}")


async def open_stores(cfg: RunConfig, bus: Bus) -> tuple[WeightStore, WeightStore | None]:
    """The full-state store and, for a mode that uses it, the delta store (the trainer and the workers open the
    same)."""
    store = await WeightStore.create(
        bus.js,
        bus.subjects.run,
        replicas=cfg.bus.replicas,
        keep_versions=cfg.sync.keep_versions,
        ensure=bus.creates_streams,
    )
    delta_store = None
    if sync_mode(cfg).uses_delta_store:
        delta_store = await WeightStore.create(
            bus.js,
            bus.subjects.run,
            replicas=cfg.bus.replicas,
            keep_versions=delta_keep_versions(cfg.sync.keep_versions, cfg.sync.anchor_every),
            kind="delta",
            ensure=bus.creates_streams,
        )
    return store, delta_store


async def build_sender(cfg: RunConfig, bus: Bus, ranks: LeaderRanks, run_dir: Path, log: Any) -> WeightSender:
    """The trainer leader's weight sender (its transport is opened by :meth:`WeightSender.connect`)."""
    store, delta_store = await open_stores(cfg, bus)
    return WeightSender(cfg, bus, ranks, run_dir, store, delta_store, log)
