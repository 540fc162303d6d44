"""The trainer's side of weight sync: one object that turns the trained weights into a published version.

:func:`build_sender` opens the data-plane stores, the publish path of ``sync.mode`` and, once the trainer
knows whether this is the run's first start, the payload transport that ``sync.transport`` names. The
trainer then calls :meth:`WeightSender.publish` and nothing else of sync. Transports are registered by name
(:func:`register_transport`), so a new one is a factory here, not a branch in the trainer.

* ``full``: the export streams into the transport one parameter at a time; no rank holds the whole state.
* ``delta`` / ``lora``: the state (or only the adapter) is collected on rank 0 and published by
  :class:`~miles.sync.publisher.WeightPublisher`, which keeps the previous state to diff against.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles.bus.schema import WeightsAnnounced
from miles.models.families.registry import family_of
from miles.plugins import Registry
from miles.sync.publisher import Lineage, Published, WeightPublisher, announce, delta_keep_versions
from miles.sync.stream_export import PayloadLayout
from miles.sync.transport.base import WeightTransport
from miles.sync.transport.broadcast import BroadcastTransport, join_run_group
from miles.sync.transport.bus import BusTransport
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


TRANSPORTS: Registry[Awaitable[WeightTransport]] = Registry("weight transport")  # factory(TransportContext)
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
        # Keeps the last published state in memory (delta mode): after a restart the first publish is a full anchor.
        self.publisher = WeightPublisher(
            bus,
            store,
            cfg.sync.dtype,
            mode=cfg.sync.mode,
            delta_store=delta_store,
            anchor_every=cfg.sync.anchor_every,
            sha256=cfg.bus.payload_sha256,
        )

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
        """Export the current weights and publish (and announce) them as ``version``."""
        if self.cfg.sync.mode == "full":
            return await self._stream(version, lineage)
        return await self.publisher.publish(await self._collect(), version, lineage)

    async def _stream(self, version: int, lineage: Lineage) -> Published:
        precision = self.cfg.sync.dtype
        family = family_of(self.cfg.model)  # its quantization rule picks what FP8/FP4 quantize
        layout = PayloadLayout.plan(
            self.ranks.worker.backend.export_specs(), precision, version, family, sha256=self.cfg.bus.payload_sha256
        )
        out = await self.transport.publish(layout, lambda: self.ranks.export_stream(False), run=self.ranks.run)
        announcement = WeightsAnnounced(
            **out.announcement_fields(),
            transport=out.transport,
            location=Path(out.location).name if out.transport == "fs" else out.location,
            step=lineage.step,
            consumed=list(lineage.consumed),
            replayed=lineage.replayed,
            mode="full",
            dtype=precision,
            precision=precision,
        )
        published = await announce(self.bus, announcement)
        self.log.info("weights_published", version=version, step=lineage.step, bytes=out.size, chunks=out.chunks)
        return published

    async def _collect(self) -> dict[str, torch.Tensor]:
        """The state to publish: the weights in rollout precision, or in LoRA mode only the adapter. FP8/FP4
        are quantized here, so workers run exactly these codes and scales."""
        from miles.sync.precision import is_quantized, to_rollout_state

        sync = self.cfg.sync
        state = await self.ranks.call("export", sync.mode == "lora")
        if sync.mode != "lora" and is_quantized(sync.dtype):
            return await asyncio.to_thread(to_rollout_state, state, sync.dtype, family_of(self.cfg.model))
        dtype = getattr(torch, "bfloat16" if is_quantized(sync.dtype) else sync.dtype)
        # A copy even where the dtype already matches (float32 sync): an unsharded export may yield the live
        # parameters, and the publisher keeps this state as the base of the next delta across the next step.
        return {name: t.to(dtype, copy=True) for name, t in state.items()}


async def open_stores(cfg: RunConfig, bus: Bus) -> tuple[WeightStore, WeightStore | None]:
    """The full-state store and, in delta mode, the delta store (the trainer and the workers open the same)."""
    store = await WeightStore.create(
        bus.js,
        bus.subjects.run,
        replicas=cfg.bus.replicas,
        keep_versions=cfg.sync.keep_versions,
        ensure=bus.creates_streams,
    )
    delta_store = None
    if cfg.sync.mode == "delta":
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
