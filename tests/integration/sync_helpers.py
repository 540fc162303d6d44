"""Shared pieces of the weight-sync tests: a running follower and polling waits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from miles.engines.base import StagingEngine
from miles.sync.follower import WeightFollower


@contextlib.asynccontextmanager
async def running(follower: WeightFollower) -> AsyncIterator[asyncio.Event]:
    """Run ``follower`` in the background; yields its stop event and stops it on exit."""
    stopping = asyncio.Event()
    task = asyncio.create_task(follower.run(stopping))
    try:
        yield stopping
    finally:
        stopping.set()
        await task


async def until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` every 50 ms; fail the test if it stays false for ``timeout_s``."""
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def adopted(engine: StagingEngine, version: int, timeout_s: float = 20.0) -> None:
    """Wait until ``engine`` generates with ``version``: a started engine applies what the follower staged
    by itself (at once when idle), so this is what ``follower.wait_for`` plus a switch amount to."""

    for _ in range(int(timeout_s / 0.05)):
        if engine.error is not None:
            raise AssertionError(f"the engine failed: {engine.error}")
        if engine.version == version:
            return
        await asyncio.sleep(0.05)
    pending = engine.pending_version
    raise AssertionError(f"engine never adopted version {version}: at {engine.version}, pending {pending}")
