"""Shared fixtures: a real nats-server with JetStream per test, and a client connected to it.

Function scope on purpose: every test gets an empty JetStream in its own ``tmp_path`` (no stream or
run-name collisions between tests), and starting the server costs about 0.1-0.3 s. The fixtures are
async so they live on the test's own event loop (pytest-asyncio, function-scoped loops).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from miles.bus.connect import connect
from miles.bus.server import EmbeddedNats


@pytest.fixture
async def embedded_nats(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """The running :class:`EmbeddedNats` (for tests that need its pid, log or directory)."""
    async with EmbeddedNats(tmp_path / "bus") as server:
        yield server


@pytest.fixture
async def nats_server(embedded_nats: EmbeddedNats) -> str:
    """URL of a fresh nats-server with JetStream, stored under the test's tmp_path."""
    return embedded_nats.url


@pytest.fixture
async def nc(nats_server: str) -> AsyncIterator[Client]:
    """A client connected to :func:`nats_server`, closed after the test."""
    client = await connect(nats_server, name="pytest")
    yield client
    if not client.is_closed:
        await client.close()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Every async test runs on uvloop, the loop the actors run on (``miles-node`` uses uvloop.run)."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}
