"""The rollout worker's side of weight sync: follow the announcements, fetch and verify, stage into the engine.

:func:`build_receiver` opens the same data-plane stores as the trainer, the worker side of ``sync.transport``
(registered by name in :data:`RECEIVER_TRANSPORTS`) and asks the engine for its weight sink
(``engine.weight_sink``): each engine says how a published state becomes its weights (tensors loaded in
place, a checkpoint a server reloads, an adapter a server loads), so the rollout actor knows no engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from miles.bus.client import KEY_TRAINER_VERSION
from miles.engines.base import StagingEngine
from miles.plugins import Registry
from miles.sync.follower import WeightFollower
from miles.sync.lora import lora_scale
from miles.sync.modes import sync_mode
from miles.sync.sender import TRANSPORTS, open_stores
from miles.sync.transport.base import PayloadSource, TransportBroken
from miles.sync.transport.broadcast import BroadcastReceiver, join_run_group
from miles.sync.transport.fs import FsTransport, fs_root

if TYPE_CHECKING:
    from miles.bus.client import Bus
    from miles.config import RunConfig


@dataclass(frozen=True, slots=True)
class ReceiverContext:
    """What a worker-side transport factory may use (``group_rank``: this worker's rank in a weight-update group)."""

    cfg: RunConfig
    bus: Bus
    run_dir: Path
    group_rank: int | None
    log: Any


class Service(Protocol):
    """Something a transport's worker side runs alongside the follower (a weight-update group's receiver)."""

    async def start(self) -> Any: ...

    async def stop(self) -> None: ...


@dataclass(slots=True)
class ReceiverSide:
    """A transport's worker side: where the follower fetches payloads announced with that transport (None: the
    bus data plane), and what runs alongside it. The follower knows no transport by name."""

    source: PayloadSource | None = None
    service: Service | None = None


# factory(ReceiverContext)
RECEIVER_TRANSPORTS: Registry[Awaitable[ReceiverSide]] = Registry("weight receiver", by_path=False)
register_receiver = RECEIVER_TRANSPORTS.register  # the worker side of ``sync.transport: <name>``


@register_receiver("bus")
async def _bus(ctx: ReceiverContext) -> ReceiverSide:
    return ReceiverSide()


@register_receiver("fs")
async def _fs(ctx: ReceiverContext) -> ReceiverSide:
    return ReceiverSide(source=FsTransport(fs_root(ctx.cfg, ctx.run_dir), keep_versions=ctx.cfg.sync.keep_versions))


@register_receiver("broadcast")
async def _broadcast(ctx: ReceiverContext) -> ReceiverSide:
    """Join the trainer's weight-update group, at the run's first start only (a group forms once: a worker that
    starts later, or again, takes its weights from the bus)."""
    if await ctx.bus.get_bytes(KEY_TRAINER_VERSION) is not None:
        ctx.log.warning("weight_group_not_joined", reason="the run already published weights: using the bus")
        return ReceiverSide()
    if ctx.group_rank is None:
        raise ValueError("sync.transport 'broadcast' needs this worker's --weight-group-rank (1..rollout.workers)")
    group = BroadcastReceiver(await asyncio.to_thread(join_run_group, ctx.cfg, ctx.group_rank))
    return ReceiverSide(source=group, service=group)


def check_transport(name: str) -> None:
    """:class:`~miles.plugins.PluginError` unless both sides of ``sync.transport: name`` are registered (the
    trainer's in :data:`miles.sync.sender.TRANSPORTS`, the worker's in :data:`RECEIVER_TRANSPORTS`)."""
    TRANSPORTS.factory(name)
    RECEIVER_TRANSPORTS.factory(name)


class WeightReceiver:
    """The worker's weight sync: a :class:`WeightFollower` and, for a weight-update group, its receiver."""

    def __init__(self, follower: WeightFollower, side: ReceiverSide) -> None:
        self.follower = follower
        self.side = side

    async def run(self, stopping: asyncio.Event) -> None:
        """Follow announcements until ``stopping`` (the transport's service, if any, runs alongside)."""
        service = self.side.service
        if service is not None:
            await service.start()
        try:
            await self.follower.run(stopping)
        finally:
            if service is not None:
                with contextlib.suppress(TransportBroken):  # reported when it happened; the bus took over
                    await service.stop()


async def build_receiver(
    cfg: RunConfig,
    bus: Bus,
    engine: StagingEngine,
    *,
    run_dir: Path,
    group_rank: int | None,
    log: Any,
) -> WeightReceiver:
    """The worker's weight receiver for ``cfg.sync``, staging into ``engine`` through its weight sink."""
    factory = RECEIVER_TRANSPORTS.factory(cfg.sync.transport)
    store, delta_store = await open_stores(cfg, bus)
    lora = sync_mode(cfg).worker_lora()
    sink = engine.weight_sink(cfg.sync.dtype, None if lora is None else lora_scale(lora))
    side = await factory(ReceiverContext(cfg, bus, run_dir, group_rank, log))
    follower = WeightFollower(
        bus,
        store,
        engine,
        delta_store=delta_store,
        decoder=sink,
        sources={} if side.source is None else {cfg.sync.transport: side.source},
        require_payload_sha256=cfg.bus.payload_sha256,
    )
    return WeightReceiver(follower, side)
