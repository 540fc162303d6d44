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


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_no_trained_token_is_older_than_eta(tmp_path: Path, server: EmbeddedNats, model_cache: Path, eta: int) -> None:
    cfg = small_run_config(model_cache, f"eta{eta}", **{"staleness.max_staleness": eta, "trainer.steps": 8})
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
    lags = []
    for group_id, step in trained_step.items():
        # The policy being updated at step s has version s; every token was sampled by some version <= s.
        for episode in by_group[group_id].episodes:
            lag = step - episode.oldest_version
            assert 0 <= lag <= eta, f"{group_id}: trained at step {step} with version {episode.oldest_version}"
            lags.append(lag)
    if eta == 0:
        assert set(lags) == {0}  # synchronous: every trained token came from the current policy
        # On-policy, the behaviour log-probs are the trainer's own up to bf16 rounding of the synced weights:
        # the engine-versus-trainer gap (ppo_kl at step 0 compares two trainer passes: 0 by construction).
        for line in (cluster.run_dir / "metrics.jsonl").read_text().splitlines()[:3]:
            assert json.loads(line)["logp_mismatch"] < 0.01
    assert cluster.summary()["staleness_max"] <= eta
