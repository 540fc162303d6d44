"""Fixtures of the end-to-end tests: a nats-server per test and a tiny-model cache per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.bus.server import EmbeddedNats


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this module's tiny models are built (once per config)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream for the actor processes of one test."""
    with EmbeddedNats(tmp_path / "bus") as srv:
        yield srv
