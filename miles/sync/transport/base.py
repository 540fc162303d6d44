"""The weight-transport interface: publish a version's payload, fetch and verify it on the other side.

Every transport moves the *same* thing, the rollout-precision payload of :mod:`miles.sync.stream_export`,
and reports the same facts about it (:class:`Published`: version, size, the payload's xxh3-128 ``digest``,
the ``state_digest`` of its tensors). The trainer announces those in ``weights_announced`` after the
bytes have gone out, exactly as on the bus today, so workers verify the same digests and the controller's
held-weight audit (``weights_held.state_digest`` against the announced one) is unchanged, whichever path
the bytes took. Two fields name the path (proposed for the schema): ``transport`` (``bus`` | ``fs`` |
``broadcast`` | ``sglang``) and ``location`` (the directory for ``fs``, the group name for ``broadcast``).

Trainer side, a transport gets the export as ``params``: a function that starts one (collective) export
and returns its ``(name, full tensor)`` iterator. On the trainer leader that function also tells the
other ranks to drain theirs, so a transport may call it again (a fallback re-sends a version). ``run``
executes the export on the thread that owns the torch work (``LeaderRanks.run``; ``asyncio.to_thread`` by
default); it must not be the event loop's thread, which the bus transport needs meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from miles.bus.errors import BusError, ChecksumMismatch
from miles.sync.payload import deserialize_state
from miles.sync.precision import state_digest
from miles.sync.stream_export import PayloadLayout

T = TypeVar("T")
TransportKind = str  # a transport's registered name: bus, fs, broadcast, sglang, or one of your own
Params = Callable[[], Iterable[tuple[str, torch.Tensor]]]
Runner = Callable[[Callable[[], T]], Awaitable[T]]


class TransportBroken(BusError):
    """A transport can no longer deliver (a weight-update group lost a member): use another one."""


@dataclass(frozen=True, slots=True)
class Published:
    """What the trainer announces about a published version."""

    transport: TransportKind
    version: int
    size: int  # payload bytes (sglang: tensor bytes)
    chunks: int  # data-plane chunks / broadcast buckets / fs: 1
    digest: str  # xxh3-128 of the payload ("" for sglang, which moves tensors, not a payload)
    state_digest: str
    location: str = ""
    payload_sha256: str = ""

    def announcement_fields(self) -> dict[str, Any]:
        """The ``WeightsAnnounced`` fields about the payload (version, digests, size, chunks)."""
        return {
            "version": self.version,
            "digest": self.digest,
            "size": self.size,
            "chunks": self.chunks,
            "state_digest": self.state_digest,
            "payload_sha256": self.payload_sha256,
        }

    def transport_fields(self) -> dict[str, Any]:
        """The proposed new ``WeightsAnnounced`` fields: ``transport`` and ``location``."""
        return {"transport": self.transport, "location": self.location}


class PayloadSource(Protocol):
    """A worker's way to the payloads of one transport (the follower fetches a version announced with it)."""

    async def fetch(self, version: int, digest: str, *, location: str = "") -> memoryview:
        """The payload of ``version``, verified against ``digest``."""
        ...


class WeightTransport(Protocol):
    """One way of getting a payload from the trainer leader to the rollout workers."""

    kind: ClassVar[TransportKind]

    async def publish(self, layout: PayloadLayout, params: Params, *, run: Runner | None = None) -> Published:
        """Stream the export of ``params`` (planned as ``layout``) to the readers; return what to announce."""
        ...

    async def fetch(self, version: int, digest: str, *, location: str = "") -> memoryview:
        """The payload of ``version``, verified against ``digest`` (:class:`ChecksumMismatch` otherwise;
        :class:`~miles.bus.errors.PayloadMissing` if it is not there)."""
        ...


def runner(run: Runner | None) -> Runner:
    return run if run is not None else asyncio.to_thread


def verified_state(payload: memoryview, expected_state_digest: str) -> dict[str, torch.Tensor]:
    """The tensors of a verified payload, after checking their ``state_digest`` against the announced one
    (skipped when the announcement has none). Tensors view ``payload``: keep it alive while they are used."""
    state = deserialize_state(payload)
    if expected_state_digest:
        actual = state_digest(state)
        if actual != expected_state_digest:
            raise ChecksumMismatch(f"weights state digest {actual}, announced {expected_state_digest}")
    return state
