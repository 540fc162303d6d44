"""Exactly-once training across trainer crashes: SIGKILL the trainer 10 times in one run, restart it each time.

Kills land inside a step (weights updated, nothing published), mid-export (part of a payload in the data
plane), between announcement and ack, mid-checkpoint (shards written, no completion marker), between steps,
and at random moments. The run must complete with every issued group accounted for; every version number
must name one set of weights; every step the trainer replayed after a restart must have consumed exactly the
trajectories of the lost step it replaces; and along the weights that survive, each step is trained once and
no group is trained twice.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from miles.bus.schema import WeightsAnnounced
from miles.bus.server import EmbeddedNats
from tests.integration.harness import Cluster, check_accounting, small_run_config, subject_messages, traj_groups_by_seq

FAILPOINTS = ["train", "export:2", "announced", "checkpoint", "between_steps:3", "export", "train:2"]


def _start_trainer(cluster: Cluster, attempt: int, failpoint: str | None) -> None:
    cluster.start_trainer(suffix=f"-{attempt}", failpoints=failpoint)


def _surviving_chain(announcements: list[WeightsAnnounced]) -> list[WeightsAnnounced]:
    """Replay the announcements in stream order: a restart republishes the restored weights (no batch) at the
    checkpoint's step, which cuts the chain back to that step; every other announcement extends it by one."""
    chain: list[WeightsAnnounced] = []
    for ann in announcements:
        if not ann.consumed:
            chain = [a for a in chain if a.step <= ann.step]
            continue
        last = chain[-1].step if chain else 0
        assert ann.step == last + 1, f"version {ann.version} at step {ann.step} does not follow step {last}"
        chain.append(ann)
    return chain


@pytest.mark.slow
def test_trainer_killed_ten_times_trains_every_step_once(
    tmp_path: Path, server: EmbeddedNats, model_cache: Path
) -> None:
    cfg = small_run_config(
        model_cache,
        "crash",
        **{"trainer.steps": 48, "trainer.checkpoint_every": 3, "eval.every": 0, "rollout.groups_in_flight": 2},
    )
    from miles.prepare import prepare

    prepare(cfg)
    cluster = Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=server.url)
    rng = random.Random(7)
    kills = 0
    try:
        cluster.start("controller", "controller")
        cluster.start("rollout-0", "rollout")
        cluster.start("rollout-1", "rollout")
        for attempt in range(10):
            failpoint = FAILPOINTS[attempt] if attempt < len(FAILPOINTS) else None
            _start_trainer(cluster, attempt, failpoint)
            name = f"trainer-{attempt}-0"
            proc = cluster.procs[name]
            if failpoint is None:  # a random moment soon after this trainer's first new step
                recorded = cluster.steps_recorded()
                cluster.wait_for(lambda: cluster.steps_recorded() > recorded, 180, "progress")  # noqa: B023
                # A step takes tens of ms on a quiet machine: kill within a few of them, well before the end
                # (48 steps leave room for three random kills after the seven failpoints).
                time.sleep(rng.uniform(0.0, 0.1))
                if proc.poll() is None:
                    cluster.kill(name)
            else:
                deadline = time.monotonic() + 240
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert proc.poll() is not None, f"failpoint {failpoint} never fired:\n{cluster.log(name)[-2000:]}"
            assert proc.returncode == -9, f"{name} exited {proc.returncode}:\n{cluster.log(name)[-3000:]}"
            kills += 1
        cluster.start_trainer(suffix="-final")
        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 300, "the end of the run")
        cluster.wait_all_exit(60)
    finally:
        cluster.stop()
    assert kills == 10
    summary = cluster.summary()
    assert summary["status"] == "complete" and summary["steps"] == cfg.trainer.steps
    check_accounting(cluster)

    run, url = cfg.name, server.url
    announced = asyncio.run(subject_messages(url, f"{run}_EVENTS", f"{run}.events.weights", WeightsAnnounced))
    versions = [a.version for a in announced]
    assert len(versions) == len(set(versions)), "a version number was announced twice"
    assert versions == sorted(versions), "version numbers went backwards"
    digests: dict[int, set[str]] = {}
    for a in announced:
        digests.setdefault(a.version, set()).add(a.state_digest)
    assert all(len(d) == 1 for d in digests.values())

    # Every replayed step trained exactly the batch of a step that an earlier branch had published.
    by_step: dict[int, list[WeightsAnnounced]] = {}
    for a in announced:
        if a.consumed:
            by_step.setdefault(a.step, []).append(a)
    replays = [a for a in announced if a.replayed and a.consumed]
    assert replays, "no step was replayed: the kills never lost a published step"
    for r in replays:
        earlier = [a for a in by_step[r.step] if a.version < r.version]
        assert earlier and all(a.consumed == r.consumed for a in earlier), f"replay of step {r.step} differs"

    # Along the surviving weights: steps 1..N once each, and no group trained twice.
    chain = _surviving_chain(announced)
    assert [a.step for a in chain] == list(range(1, cfg.trainer.steps + 1))
    groups = asyncio.run(traj_groups_by_seq(url, run))
    trained = [groups[seq] for a in chain for seq in a.consumed]
    assert len(trained) == len(set(trained)) == cfg.trainer.steps * cfg.trainer.groups_per_step
    assert summary["steps_replayed"] >= 1
