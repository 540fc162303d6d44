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
from collections.abc import Callable
from typing import ClassVar, TypeVar

from miles.bus.errors import BusError
from miles.sync.stream_export import PayloadLayout, Sink, encode_payload
from miles.sync.transport.base import Params, Published, Runner, TransportKind, runner
from miles.sync.transport.dataplane import PayloadInfo, WeightStore

T = TypeVar("T")


async def write_streamed(
    store: WeightStore, version: int, size: int | None, produce: Callable[[Sink], T], run: Runner | None
) -> tuple[PayloadInfo, T]:
    """Run ``produce(sink)`` on the torch thread (``run``), every piece it hands to ``sink`` going into
    ``store`` as ``version`` (``size``: the payload's, if known in advance); the stored payload's info and what
    ``produce`` returned."""
    loop = asyncio.get_running_loop()
    async with store.writer(version, size) as writer:

        def sink(piece: memoryview) -> None:  # on the torch thread: wait until the loop took the piece
            asyncio.run_coroutine_threadsafe(writer.write(piece), loop).result()

        result = await runner(run)(lambda: produce(sink))
    if writer.info is None:
        raise BusError(f"weights v{version}: the store recorded nothing")
    return writer.info, result


def stored(info: PayloadInfo, state_digest: str, payload_sha256: str = "") -> Published:
    """What to announce about a payload written into a data-plane store."""
    return Published(
        transport="bus",
        version=info.version,
        size=info.size,
        chunks=info.chunks,
        digest=info.digest,
        state_digest=state_digest,
        payload_sha256=payload_sha256,
    )


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
        info, summary = await write_streamed(
            self.store, layout.version, layout.size, lambda sink: encode_payload(layout, params(), sink), run
        )
        if info.digest != summary.digest or info.size != summary.size:
            raise BusError(f"weights v{layout.version}: the store recorded {info}, the encoder {summary}")
        return stored(info, summary.state_digest, summary.payload_sha256)

    async def fetch(self, version: int, digest: str, *, location: str = "") -> memoryview:
        return await self.store.get(version, expected_digest=digest)
