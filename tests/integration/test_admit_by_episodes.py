"""``rollout.admit_by: episodes`` in a real run (controller, two workers, trainer as processes): each finished
episode gives its seat back, so a worker may hold more groups than ``groups_in_flight``; the run still trains
every step once, within the staleness bound, with nothing lost or trained twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.bus.server import EmbeddedNats

from .harness import run_to_completion, small_run_config

pytestmark = pytest.mark.slow


def test_a_run_admitting_by_episodes_trains_every_step_once(
    tmp_path: Path, server: EmbeddedNats, model_cache: Path
) -> None:
    cfg = small_run_config(
        model_cache,
        "seats",
        **{
            "rollout.admit_by": "episodes",
            "rollout.groups_in_flight": 2,
            "staleness.max_staleness": 2,
            "staleness.stale_prefix": "mask",
            "trainer.steps": 12,
        },
    )
    cluster = run_to_completion(cfg, tmp_path / "run", server.url, timeout_s=300)  # also check_accounting()
    summary = cluster.summary()
    assert summary["status"] == "complete" and summary["steps"] == cfg.trainer.steps
    assert summary["trajectories_trained"] == cfg.trainer.steps * cfg.trainer.groups_per_step
    assert summary["staleness_max"] <= cfg.staleness.max_staleness
    assert summary["dead_lettered"] == 0
