"""The staleness bound, checked from the record: every trained token's version against the step that used it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from miles.bus.connect import connect
from miles.bus.schema import Trajectory, decode
from miles.bus.server import EmbeddedNats

from .harness import Cluster, check_accounting, small_run_config

pytestmark = pytest.mark.slow


async def _all_trajectories(url: str, run: str) -> list[Trajectory]:
    """Every trajectory ever published in the run (the TRAJ stream keeps them after the trainer acks)."""
    nc = await connect(url, name="audit")
    js = nc.jetstream()
    total = (await js.stream_info(f"{run}_TRAJ")).state.messages
    sub = await js.subscribe(f"{run}.traj", ordered_consumer=True)
    out = []
    for _ in range(total):
        msg = await sub.next_msg(timeout=10)
        out.append(decode(msg.data, Trajectory))
    await nc.close()
    return out


@pytest.mark.parametrize(("eta", "stale_prefix"), [(0, "mask"), (1, "mask"), (3, "mask"), (1, "discard")])
def test_no_trained_token_is_older_than_eta(
    tmp_path: Path, server: EmbeddedNats, model_cache: Path, eta: int, stale_prefix: str
) -> None:
    """Token by token: a trained token is at most eta versions older than the step that trains it. With
    ``stale_prefix: mask`` (the default) a long answer's older tokens stay in the sequence out of the loss, and
    their count is the trainer's ``stale_tokens_masked``; with ``discard`` there are none. Long-tailed answers
    (the copy task, up to 57 tokens) so that some answers run across versions."""
    sets = {
        "task": {"type": "copy", "median_len": 4, "sigma": 1.1, "max_len": 56},
        "rollout.sampling.max_new_tokens": 57,
        "rollout.group_size": 8,
        "rollout.groups_in_flight": 4,
        "trainer.groups_per_step": 8,
        "model.warmup_target_accuracy": None,
        "staleness.max_staleness": eta,
        "staleness.stale_prefix": stale_prefix,
        "trainer.steps": 8,
    }
    cfg = small_run_config(model_cache, f"eta{eta}{stale_prefix}", **sets)
    from miles.prepare import prepare

    prepare(cfg)
    cluster = Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=server.url)
    try:
        cluster.start_all(rollouts=2, ranks=1)
        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 300, "the end of the run")
        trajectories = asyncio.run(_all_trajectories(server.url, cfg.name))
        cluster.wait_all_exit(60)
    finally:
        cluster.stop()
    check_accounting(cluster)

    by_group = {t.group_id: t for t in trajectories}
    assert len(by_group) == len(trajectories), "a clean run publishes one trajectory per group"
    trained_step = {row["group_id"]: row["step"] for row in cluster.ledger() if row["event"] == "trained"}
    assert len(trained_step) == cfg.trainer.steps * cfg.trainer.groups_per_step
    lags, masked = [], 0
    for group_id, step in trained_step.items():
        # The policy being updated at step s has version s; every token was sampled by some version <= s.
        trajectory = by_group[group_id]
        judged = trajectory.newest_version if stale_prefix == "mask" else trajectory.oldest_version
        assert 0 <= step - judged <= eta, f"{group_id}: trained at step {step}, judged at version {judged}"
        for episode in trajectory.trained_episodes:
            for in_loss, version in zip(episode.loss_mask, episode.token_versions(), strict=True):
                assert 0 <= step - version, f"{group_id}: a token of version {version} trained at step {step}"
                if in_loss and step - version > eta:
                    masked += 1  # too old: left out of the loss
                elif in_loss:
                    lags.append(step - version)
    assert masked == cluster.summary()["stale_tokens_masked"]
    if stale_prefix == "discard":
        assert masked == 0
    if eta == 0:
        assert set(lags) == {0}  # synchronous: every trained token came from the current policy
        # On-policy, the behaviour log-probs are the trainer's own up to bf16 rounding of the synced weights:
        # the engine-versus-trainer gap (ppo_kl at step 0 compares two trainer passes: 0 by construction).
        for line in (cluster.run_dir / "metrics.jsonl").read_text().splitlines()[:3]:
            assert json.loads(line)["logp_mismatch"] < 0.01
    assert cluster.summary()["staleness_max"] <= eta
