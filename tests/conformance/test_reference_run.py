"""A real run whose only rollout worker is the reference worker of examples/ (written from the docs alone).

Controller and trainer are ``miles-node`` processes, the worker is ``python examples/reference_worker.py``
with nothing but the NATS URL, the run name and its id: the run completes, every trajectory is the
reference worker's, and every version it generated with was reported with the trainer's digest.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.bus.schema import Trajectory
from miles.bus.server import EmbeddedNats
from tests.integration.harness import Cluster, check_accounting, check_held_weights, small_run_config, subject_messages

from .conftest import REFERENCE_WORKER

pytestmark = pytest.mark.slow


def test_a_run_completes_with_the_reference_worker_as_its_only_rollout_worker(tmp_path: Path) -> None:
    from miles.prepare import prepare

    cfg = small_run_config(tmp_path / "models", "refrun", **{"rollout.workers": 1, "trainer.steps": 2})
    prepare(cfg)  # for the controller and the trainer; the worker takes everything from the bus
    with EmbeddedNats(tmp_path / "bus") as server:
        cluster = Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=server.url)
        try:
            cluster.start("controller", "controller")
            cluster.start_trainer(ranks=1)
            with open(cluster.run_dir / "reference-0.log", "ab") as log:
                cmd = [sys.executable, str(REFERENCE_WORKER), "--nats-url", server.url, "--run", cfg.name]
                cluster.procs["reference-0"] = subprocess.Popen(
                    [*cmd, "--worker-id", "reference-0"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
                    cwd=tmp_path,  # nothing of the repository's working directory is needed
                )
            cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 300, "the end of the run")
            cluster.wait_all_exit(60)
        finally:
            cluster.stop()
        summary = cluster.summary()
        assert summary["status"] == "complete", summary
        assert summary["steps"] == cfg.trainer.steps
        assert summary["trajectories_trained"] == cfg.trainer.steps * cfg.trainer.groups_per_step
        assert summary["dead_lettered"] == 0
        assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
        check_accounting(cluster)
        check_held_weights(cluster)  # every version generated with was reported, with the announced digest
        trajectories = asyncio.run(subject_messages(server.url, f"{cfg.name}_TRAJ", f"{cfg.name}.traj", Trajectory))
        assert {t.worker_id for t in trajectories} == {"reference-0"}
        for name, proc in cluster.procs.items():
            assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{cluster.log(name)[-2000:]}"
