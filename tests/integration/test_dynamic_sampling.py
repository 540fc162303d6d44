"""DAPO's dynamic sampling across actors: the trainer filters groups whose rewards are all equal, reports them
like discards, the controller re-issues their credit (and over-issues), and every step still trains a full
batch. Checked from the bus streams and the run record of a real run (controller, two workers, trainer)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from miles.algo.filters import has_reward_variance
from miles.bus.schema import GroupsDiscarded, Trajectory
from miles.bus.server import EmbeddedNats

from .harness import run_to_completion, small_run_config, subject_messages

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("eta", [0, 1])
def test_filtered_groups_are_counted_replaced_and_every_step_is_full(
    tmp_path: Path, server: EmbeddedNats, model_cache: Path, eta: int
) -> None:
    cfg = small_run_config(
        model_cache,
        f"dapo{eta}",
        **{
            "staleness.max_staleness": eta,  # eta 0: the tightest credit window, where a lost credit would stall
            "trainer.steps": 6,
            "trainer.algo.filter": {"type": "reward_variance", "over_issue": 0.5},
        },
    )
    cluster = run_to_completion(cfg, tmp_path / "run", server.url, timeout_s=300)  # also check_accounting()
    summary = cluster.summary()
    assert summary["status"] == "complete" and summary["steps"] == cfg.trainer.steps

    ledger = cluster.ledger()
    events = Counter(row["event"] for row in ledger)
    per_step = Counter(row["step"] for row in ledger if row["event"] == "trained")
    batch = cfg.trainer.groups_per_step
    assert per_step == {step: batch for step in range(cfg.trainer.steps)}, "a step trained less than a full batch"
    assert events["filtered"] > 0, "the filter never acted: the test would prove nothing"
    assert summary["discard_reasons"].get("filtered", 0) == events["filtered"]
    metrics = [json.loads(line) for line in (cluster.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["groups_filtered"] for m in metrics) == events["filtered"]
    assert all(m["groups_equal_rewards"] == 0 for m in metrics)  # nothing signal-less was trained
    # Over-issued: the filtered groups' credits came back and bought replacements.
    assert events["issued"] >= cfg.trainer.steps * batch + events["filtered"]

    run = cfg.name
    trajectories = asyncio.run(subject_messages(server.url, f"{run}_TRAJ", f"{run}.traj", Trajectory))
    discards = asyncio.run(subject_messages(server.url, f"{run}_EVENTS", f"{run}.events.discarded", GroupsDiscarded))
    by_group = {t.group_id: t for t in trajectories}
    filtered = {gid for d in discards if d.reason == "filtered" for gid in d.group_ids}
    assert all(not d.requeue for d in discards if d.reason == "filtered")  # DAPO draws new prompts instead
    assert filtered == {row["group_id"] for row in ledger if row["event"] == "filtered"}
    for gid in filtered:
        rewards = [float(e.reward) for e in by_group[gid].trained_episodes]  # type: ignore[arg-type]
        assert not has_reward_variance(rewards), f"{gid} was filtered with rewards {rewards}"
    for row in ledger:
        if row["event"] == "trained":
            rewards = [float(e.reward) for e in by_group[row["group_id"]].trained_episodes]  # type: ignore[arg-type]
            assert has_reward_variance(rewards), f"{row['group_id']} was trained with equal rewards {rewards}"
