"""A weight transport that falls back for good: a broadcast group until it breaks, then the bus."""

from __future__ import annotations

from typing import ClassVar

import structlog

from miles.sync.stream_export import PayloadLayout
from miles.sync.transport.base import Params, Published, Runner, TransportBroken, TransportKind, WeightTransport

log = structlog.get_logger(__name__)


class FallbackTransport:
    """``primary`` (a broadcast group) until it breaks, then ``fallback`` (the bus) for good.

    A version whose primary publish fails with :class:`TransportBroken` is exported again into the fallback
    (``params`` starts a fresh export), so it is announced once, complete, under the fallback's name; every
    later version goes straight to the fallback. :meth:`restore` installs a re-formed primary.
    """

    kind: ClassVar[TransportKind] = "bus"

    def __init__(self, primary: WeightTransport, fallback: WeightTransport) -> None:
        self.primary: WeightTransport | None = primary
        self.fallback = fallback
        self.fallbacks = 0

    def restore(self, primary: WeightTransport) -> None:
        self.primary = primary

    async def publish(self, layout: PayloadLayout, params: Params, *, run: Runner | None = None) -> Published:
        if self.primary is not None:
            try:
                return await self.primary.publish(layout, params, run=run)
            except TransportBroken as exc:
                log.error("weights_transport_fallback", version=layout.version, error=str(exc), to=self.fallback.kind)
                self.primary = None
                self.fallbacks += 1
        return await self.fallback.publish(layout, params, run=run)

    async def fetch(self, version: int, digest: str, *, location: str = "") -> memoryview:
        return await self.fallback.fetch(version, digest, location=location)
