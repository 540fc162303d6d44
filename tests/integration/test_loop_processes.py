"""The RL loop as separate ``miles-node`` processes against one real nats-server.

Each test starts a controller, rollout workers and trainer ranks as OS processes, exactly as a
multi-machine deployment would, and checks the run's record (summary.json, groups.jsonl).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import msgpack
import pytest

from miles.bus.connect import connect
from miles.bus.schema import SCHEMA_VERSION
from miles.bus.server import EmbeddedNats
from miles.training.checkpoint import CheckpointManager

from .harness import Cluster, check_accounting, small_run_config

pytestmark = pytest.mark.slow


def _cluster(tmp_path: Path, server: EmbeddedNats, model_cache: Path, name: str, **overrides: object) -> Cluster:
    cfg = small_run_config(model_cache, name, **overrides)
    from miles.prepare import prepare

    prepare(cfg)  # build once, before the processes race for it
    return Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=server.url)


async def _stream_size(url: str, stream: str) -> int:
    nc = await connect(url, name="probe")
    try:
        return int((await nc.jetstream().stream_info(stream)).state.messages)
    except Exception:  # not created yet
        return 0
    finally:
        await nc.close()


async def _publish_garbage(url: str, run: str) -> int:
    """Garbage bytes and well-formed messages of a wrong schema/kind on the trajectory subject."""
    nc = await connect(url, name="garbage")
    js = nc.jetstream()
    payloads = [
        b"\x00\xffnot msgpack at all",
        msgpack.packb({"schema": SCHEMA_VERSION + 7, "kind": "trajectory"}),
        msgpack.packb({"schema": SCHEMA_VERSION, "kind": "prompt_group", "group_id": "x"}),
        msgpack.packb({"schema": SCHEMA_VERSION, "kind": "trajectory", "group_id": 5}),
    ]
    for p in payloads:
        await js.publish(f"{run}.traj", p)
    await js.publish(f"{run}.prompts", b"garbage prompt")
    await nc.close()
    return len(payloads) + 1


def test_split_processes_two_ranks_with_garbage(tmp_path: Path, server: EmbeddedNats, model_cache: Path) -> None:
    cluster = _cluster(tmp_path, server, model_cache, "split")
    try:
        cluster.start("controller", "controller")
        cluster.start("rollout-0", "rollout")
        cluster.start("rollout-1", "rollout")
        cluster.start_trainer(ranks=2)  # workers generate only once the trainer has published version 0
        # Garbage goes in while the run is under way (workers producing), ahead of trajectories the trainer
        # has yet to consume: admission holds back all but (eta + 1) steps' worth of groups until the trainer
        # trains, and it reads the stream in order, so every piece is met before the last step.
        cluster.wait_for(lambda: asyncio.run(_stream_size(server.url, "split_TRAJ")) >= 1, 240, "a trajectory")
        injected = asyncio.run(_publish_garbage(server.url, cluster.cfg.name))
        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 300, "the end of the run")
        cluster.wait_all_exit(60)
    finally:
        cluster.stop()
    summary = cluster.summary()
    assert summary["steps"] == cluster.cfg.trainer.steps
    assert summary["dlq_messages"] == injected  # the DLQ stream holds every refused piece
    # The actors' own counts, from their heartbeats: a refusal sends one at once (this run ends well within a
    # heartbeat period of refusing the garbage, which the summary missed when counts waited for the period).
    assert summary["dead_lettered"] == injected
    assert summary["staleness_max"] <= cluster.cfg.staleness.max_staleness
    assert summary["trajectories_trained"] == cluster.cfg.trainer.steps * cluster.cfg.trainer.groups_per_step
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    check_accounting(cluster)
    for name, proc in cluster.procs.items():
        assert proc.returncode == 0, f"{name} exited with {proc.returncode}"


async def _redeliveries(url: str, run: str) -> int:
    """Deliveries of the shared rollout consumer beyond one per prompt (consumer seq counts every delivery)."""
    nc = await connect(url, name="probe")
    info = await nc.jetstream().consumer_info(f"{run}_PROMPTS", "rollout")
    await nc.close()
    return int(info.delivered.consumer_seq) - int(info.delivered.stream_seq)


async def _freeze_holding_prompts(url: str, run: str, worker: subprocess.Popen, timeout_s: float) -> None:
    """SIGSTOP ``worker`` (the only one consuming prompts) at a moment it holds unacked prompts."""
    nc = await connect(url, name="probe")
    js = nc.jetstream()
    try:
        for _ in range(int(timeout_s / 0.02)):
            if (await js.consumer_info(f"{run}_PROMPTS", "rollout")).num_ack_pending:
                worker.send_signal(signal.SIGSTOP)
                if (await js.consumer_info(f"{run}_PROMPTS", "rollout")).num_ack_pending:
                    return
                worker.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.02)
    finally:
        await nc.close()
    raise AssertionError("the worker never held prompts")


def test_rollout_worker_sigkill_loses_nothing(tmp_path: Path, server: EmbeddedNats, model_cache: Path) -> None:
    cluster = _cluster(tmp_path, server, model_cache, "killw", **{"trainer.steps": 40})
    try:
        # Worker 0 runs alone, so every unacked prompt is in its hands when it is frozen and SIGKILLed.
        cluster.start("controller", "controller")
        cluster.start("rollout-0", "rollout")
        cluster.start_trainer(ranks=1)
        cluster.wait_for(lambda: cluster.steps_recorded() >= 1, 240, "the first step")
        asyncio.run(_freeze_holding_prompts(server.url, "killw", cluster.procs["rollout-0"], 120))
        cluster.kill("rollout-0")
        cluster.start("rollout-1", "rollout")  # gets the dead worker's prompts once ack_wait expires
        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 300, "the end of the run")
        redelivered = asyncio.run(_redeliveries(server.url, "killw"))
        cluster.wait_all_exit(60)
    finally:
        cluster.stop()
    assert redelivered >= 1, "the killed worker's prompts were never redelivered"
    summary = cluster.summary()
    assert summary["steps"] == 40
    assert summary["staleness_max"] <= cluster.cfg.staleness.max_staleness
    events = check_accounting(cluster)
    assert len(events["trained"]) == 40 * cluster.cfg.trainer.groups_per_step


def test_trainer_sigkill_and_restart_resumes(tmp_path: Path, server: EmbeddedNats, model_cache: Path) -> None:
    steps = 40
    cluster = _cluster(tmp_path, server, model_cache, "killt", **{"trainer.steps": steps})
    try:
        cluster.start_all(rollouts=2, ranks=1)
        # Killed once a checkpoint is complete (saves are asynchronous: under load the step-2 one may still
        # be on its way at step 3), so the restart resumes from it rather than replaying from step 0.
        checkpoints = CheckpointManager(cluster.run_dir / "checkpoints", every=1, keep=1)
        cluster.wait_for(lambda: checkpoints.latest() is not None, 240, "a complete checkpoint")
        cluster.kill("trainer-0")
        killed_at = cluster.steps_recorded()
        assert killed_at < steps, "the run ended before the trainer could be killed mid-run"
        cluster.start_trainer(ranks=1, suffix="b")
        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 300, "the end of the run")
        cluster.wait_all_exit(60)
    finally:
        cluster.stop()
    assert "trainer_resumed" in cluster.log("trainerb-0")
    summary = cluster.summary()
    assert summary["steps"] == steps
    events = check_accounting(cluster)  # no group trained twice, none lost
    assert len(events["trained"]) == steps * cluster.cfg.trainer.groups_per_step
