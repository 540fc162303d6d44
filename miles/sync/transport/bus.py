"""The bus data plane as a weight transport: the streamed payload goes into JetStream as it is produced.

The export runs on the torch thread; each piece it produces is handed to the event loop's
:class:`~miles.sync.transport.dataplane.PayloadWriter` and the torch thread waits until the writer has taken it (the
writer copies it into a chunk or into nats-py's send buffer). That hand-off is the back-pressure: the
exporting rank holds one parameter, one chunk being assembled and at most the writer's window of chunks
awaiting acks, never the payload. Readers are unchanged (:meth:`~miles.sync.transport.dataplane.WeightStore.get`):
the stored chunks and manifest are those of a whole-payload ``put``.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from miles.bus.errors import BusError
from miles.sync.stream_export import PayloadLayout, encode_payload
from miles.sync.transport.base import Params, Published, Runner, TransportKind, runner
from miles.sync.transport.dataplane import WeightStore


class BusTransport:
    """Publishes into (and fetches from) a :class:`WeightStore`."""

    kind: ClassVar[TransportKind] = "bus"

    def __init__(self, store: WeightStore) -> None:
        self.store = store

    async def publish(self, layout: PayloadLayout, params: Params, *, run: Runner | None = None) -> Published:
        # An export cut off by an outage (a chunk's ack lost in a server restart) is exported again from the
        # start, within the bus's outage budget: the writer purges the partial version first.
        return await self.store.retried(
            lambda: self._publish(layout, params, run), what=f"weights v{layout.version} into the data plane"
        )

    async def _publish(self, layout: PayloadLayout, params: Params, run: Runner | None) -> Published:
        loop = asyncio.get_running_loop()
        async with self.store.writer(layout.version, layout.size) as writer:

            def sink(piece: memoryview) -> None:  # on the torch thread: wait until the loop took the piece
                asyncio.run_coroutine_threadsafe(writer.write(piece), loop).result()

            summary = await runner(run)(lambda: encode_payload(layout, params(), sink))
        info = writer.info
        if info is None or info.digest != summary.digest or info.size != summary.size:
            raise BusError(f"weights v{layout.version}: the store recorded {info}, the encoder {summary}")
        return Published(
            transport="bus",
            version=layout.version,
            size=info.size,
            chunks=info.chunks,
            digest=info.digest,
            state_digest=summary.state_digest,
            payload_sha256=summary.payload_sha256,
        )

    async def fetch(self, version: int, digest: str, *, location: str = "") -> memoryview:
        return await self.store.get(version, expected_digest=digest)
