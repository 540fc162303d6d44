"""One conformance session per worker implementation, shared by the checks of this package.

Workers under test: the project's (``miles-node --role rollout``), the reference worker in
``examples/reference_worker.py``, and, when ``MILES_CONFORMANCE_WORKER`` is set, any other: a command line
with ``{nats_url}``, ``{run}`` and ``{worker_id}`` placeholders, e.g.
``MILES_CONFORMANCE_WORKER="./my-worker --server {nats_url} --run {run} --id {worker_id}" pytest tests/conformance``.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.bus.server import EmbeddedNats
from miles.config import RunConfig, dump_config
from miles.launch import node_command
from tests.integration.harness import small_run_config

from .driver import Driver, Record

REPO = Path(__file__).resolve().parents[2]
REFERENCE_WORKER = REPO / "examples" / "reference_worker.py"
WORKERS = ["miles", "reference", *(["custom"] if os.environ.get("MILES_CONFORMANCE_WORKER") else [])]


def conformance_config(model_cache: Path, name: str, **overrides: object) -> RunConfig:
    sets: dict[str, object] = {
        "rollout.group_size": 3,
        "rollout.sampling.top_p": 0.95,
        "rollout.sampling.max_new_tokens": 3,
    }
    sets.update(overrides)
    return small_run_config(model_cache, name, **sets)


def worker_command(kind: str, cfg: RunConfig, run_dir: Path, url: str, worker_id: str) -> list[str]:
    if kind == "miles":
        config_path = run_dir / "config.yaml"
        config_path.write_text(dump_config(cfg))
        return node_command("rollout", config_path, run_dir, url, "--actor-id", worker_id)
    if kind == "reference":
        return [sys.executable, str(REFERENCE_WORKER), "--nats-url", url, "--run", cfg.name, "--worker-id", worker_id]
    template = os.environ["MILES_CONFORMANCE_WORKER"]
    return shlex.split(template.format(nats_url=url, run=cfg.name, worker_id=worker_id))


@pytest.fixture(scope="package")
def conformance_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conformance-models")


@pytest.fixture(scope="package", params=WORKERS)
def record(
    request: pytest.FixtureRequest, conformance_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Record]:
    """The record of one session with the worker ``request.param``."""
    from miles.prepare import prepare

    kind = request.param
    cfg = conformance_config(conformance_models, f"conf-{kind}")
    prepare(cfg)
    base = tmp_path_factory.mktemp(f"conformance-{kind}")
    run_dir = base / "run"
    run_dir.mkdir()
    worker_id = f"{kind}-worker-0"
    with EmbeddedNats(base / "bus") as server:
        driver = Driver(
            cfg,
            server.url,
            worker_command(kind, cfg, run_dir, server.url, worker_id),
            worker_id,
            run_dir / "worker.log",
        )
        yield asyncio.run(driver.session())
