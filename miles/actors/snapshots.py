"""The controller's snapshots: when one may be cut, and reading the newest back.

A snapshot (:class:`~miles.bus.schema.ControllerSnapshot`) is the controller's state as the fold of EVENTS and
METRICS up to a position per subject. The state is changed by several concurrent readers (one per subject, the
announcement reader, the admission task), and a reader can be part-way through a message across an ``await``
(a dead letter, an evaluation's result published). A snapshot cut then would hold a change without the position
that says it was made, and a restart would make it twice. :class:`FoldGate` prevents that: every change runs
inside :meth:`FoldGate.folding`, and a cut waits, in :meth:`FoldGate.quiet`, until none runs. A reader that
only waits for something (a step report for its announcement) steps outside (:meth:`FoldGate.outside`) before
it has changed anything, so a cut never waits on the reader it is holding back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from miles.bus.client import Bus
from miles.bus.follow import stored_messages
from miles.bus.schema import ControllerSnapshot

# What a snapshot's positions are kept for: each subject of EVENTS the controller folds, and METRICS.
EVENT_KEYS = ("weights", "discarded", "weights_held", "eval_results")
FOLDED = ("metrics", *EVENT_KEYS)


class FoldGate:
    """Changes to the controller's state on one side, snapshot cuts on the other: never both at once."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._folding = 0  # changes in progress
        self._cutting = False

    @asynccontextmanager
    async def folding(self) -> AsyncIterator[None]:
        """Around a change of the state and its position: waits while a snapshot is being cut."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._cutting)
            self._folding += 1
        try:
            yield
        finally:
            async with self._changed:
                self._folding -= 1
                self._changed.notify_all()

    @asynccontextmanager
    async def outside(self) -> AsyncIterator[None]:
        """Inside :meth:`folding`, around a wait that comes before any change: a cut may happen meanwhile."""
        async with self._changed:
            self._folding -= 1
            self._changed.notify_all()
        try:
            yield
        finally:
            async with self._changed:
                await self._changed.wait_for(lambda: not self._cutting)
                self._folding += 1

    @asynccontextmanager
    async def quiet(self) -> AsyncIterator[None]:
        """Holds every change back, once none is in progress: cut the snapshot inside, without awaiting."""
        async with self._changed:
            self._cutting = True
            await self._changed.wait_for(lambda: self._folding == 0)
        try:
            yield
        finally:
            async with self._changed:
                self._cutting = False
                self._changed.notify_all()


async def newest_snapshot(bus: Bus) -> ControllerSnapshot | None:
    """The newest snapshot the controller wrote that can be believed (decoded, and signed when signatures are
    required), or None. A refused one is dead-lettered and counted, and the one before it is taken."""
    s = bus.subjects
    newest: ControllerSnapshot | None = None
    async for raw in stored_messages(bus.js, s.snapshot_stream, s.snapshot):  # the stream keeps the newest two
        snapshot = await bus.accept(raw, ControllerSnapshot)
        if snapshot is not None:
            newest = snapshot
    return newest
