"""Runs that survive the bus: the only server SIGKILLed and restarted, a cluster node lost, the controller killed.

Real nats-servers, real ``miles-node`` processes, no outside supervisor: nobody restarts an actor. Each run
must complete, and its accounting is checked from the server's own streams (issue records, step reports,
discards, trajectories' tickets) against summary.json, metrics.jsonl and the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from miles.actors.snapshots import newest_snapshot
from miles.bus.client import Bus
from miles.bus.cluster import NatsCluster
from miles.bus.retry import Outage, resilient_jetstream
from miles.bus.schema import ControllerSnapshot
from miles.bus.server import EmbeddedNats
from miles.bus.streams import ensure_run_streams
from miles.bus.subjects import Subjects
from miles.launch import node_command
from miles.ports import free_port
from miles.prepare import prepare
from tests.integration.harness import (
    Cluster,
    StreamRecord,
    check_stream_accounting,
    read_stream_record,
    small_run_config,
)

pytestmark = pytest.mark.slow


def _run(cfg_name: str, model_cache: Path, **overrides: object):  # noqa: ANN202 - a RunConfig
    # No checkpoint before the end: nobody kills the trainer here, and checkpoints cost most of a step's CPU.
    sets = {
        "trainer.steps": 8,
        "eval.every": 4,
        "trainer.checkpoint_every": 50,
        "bus.outage_budget_s": 60.0,
        "monitor.plots": False,
    }
    sets.update(overrides)
    cfg = small_run_config(model_cache, cfg_name, **sets)
    prepare(cfg)
    return cfg


def _finish(
    cluster: Cluster,
    url: str,
    killed: tuple[str, ...] = (),
    timeout_s: float = 240,
    read_before: StreamRecord | None = None,
) -> None:
    """Wait for the end of the run: every actor the test did not kill exits 0 by itself. ``read_before``: the
    streams as read before part of them was purged (the accounting goes on from it)."""
    cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), timeout_s, "the end of the run")
    cluster.wait_all_exit(120)  # an actor mid-retry when the run ends finishes its attempt first
    for name, proc in cluster.procs.items():
        expected = -9 if name in killed else 0
        assert proc.returncode == expected, f"{name} exited {proc.returncode}:\n{cluster.log(name)[-2000:]}"
    record = asyncio.run(read_stream_record(url, cluster.cfg, role="controller", after=read_before))
    check_stream_accounting(cluster, record)


FREEZE_EVERY = "between_steps:{n}:stop"  # the trainer freezes itself before every n-th step (miles/failpoints.py)


@contextlib.contextmanager
def trainer_frozen(cluster: Cluster, what: str) -> Iterator[int]:
    """Wait for the trainer to freeze itself between two steps, hold it while ``what`` happens, then let it go
    on. The run is mid-way by construction (no race against a tiny run's ~50 ms steps): yields the steps
    recorded so far, which must be fewer than the run's."""
    cluster.wait_stopped("trainer-0", 240, what)
    try:
        recorded = cluster.steps_recorded()
        assert recorded < cluster.cfg.trainer.steps and not (cluster.run_dir / "summary.json").exists()
        yield recorded
    finally:
        cluster.resume("trainer-0")


def _kill_mid_run(cluster: Cluster, server: EmbeddedNats, outage_s: float) -> None:
    """SIGKILL the server while the trainer is frozen between two steps, let the trainer go on into the outage
    (every actor must ride it out while working), keep the server down ``outage_s`` seconds, restart it."""
    with trainer_frozen(cluster, "an outage"):
        server.kill()
    time.sleep(outage_s)  # the outage's length is the thing under test, not a wait for a state
    server.start_sync()


def test_the_only_server_killed_and_restarted_twice(tmp_path: Path, model_cache: Path) -> None:
    """Outages of 2 s and 15 s, each begun while the trainer is frozen before its 5th and 10th steps of 14, so
    both fall inside the run: every actor reconnects twice, waits (retries within bus.outage_budget_s) and the
    run completes with its accounting right."""
    server = EmbeddedNats(tmp_path / "bus", port=free_port())
    server.start_sync()
    cfg = _run("outage", model_cache, **{"trainer.steps": 14, "eval.every": 7})
    cluster = Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=server.url)
    try:
        cluster.start_all(trainer_failpoints=FREEZE_EVERY.format(n=5))  # frozen at arrivals 5 and 10 of 14
        _kill_mid_run(cluster, server, outage_s=2.0)
        _kill_mid_run(cluster, server, outage_s=15.0)
        _finish(cluster, server.url)
    finally:
        cluster.stop()
        server.stop_sync()
    for name in cluster.procs:  # each outage was felt by every actor, and ridden out
        assert cluster.log(name).count("nats_reconnected") >= 2, f"{name} did not reconnect after both outages"
    assert "bus_retrying" in "".join(cluster.log(n) for n in cluster.procs)
    _nothing_refused(cluster)


def _nothing_refused(cluster: Cluster) -> None:
    """An outage makes copies (redeliveries, publishes sent again), never forgeries: each copy is dropped by
    message id or recognised, none refused as untrusted."""
    refused = cluster.summary()["refused"]
    assert refused == {}, f"refused after the outages: {refused}"


def test_a_cluster_node_lost_twice(tmp_path: Path, model_cache: Path) -> None:
    """A fresh 3-node cluster with R3 streams, every actor started at once (each creates the streams on an
    open bus); first a node no actor is connected to is killed, then the one most actors use. The trainer
    freezes itself before every third of its 12 steps, and each loss and return happens while it is frozen,
    so each falls inside the run with steps on either side of it (one node down at a time: the streams keep
    their quorum)."""
    nats = NatsCluster(tmp_path / "cluster").start()
    cfg = _run("nodes", model_cache, **{"bus.replicas": 3, "trainer.steps": 12, "eval.every": 6})
    # Actors are given nodes 0 and 1: node 2 is one they do not use (they learn of it, but stay put).
    cluster = Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=f"{nats.node_url(0)},{nats.node_url(1)}")
    try:
        cluster.start_all(trainer_failpoints=FREEZE_EVERY.format(n=3))  # frozen at arrivals 3, 6, 9 and 12
        with trainer_frozen(cluster, "node 2 lost"):
            nats.kill(2)
        with trainer_frozen(cluster, "node 2 back"):  # caught up (its /healthz): under load that takes a while
            nats.restart(2)
        with trainer_frozen(cluster, "the used node lost"):
            used = max((0, 1), key=lambda i: nats.nodes[i].varz().get("connections", 0))
            nats.kill(used)
        with trainer_frozen(cluster, f"node {used} back"):
            nats.restart(used)
        _finish(cluster, nats.url)
    finally:
        cluster.stop()
        nats.stop()
    logs = "".join(cluster.log(n) for n in cluster.procs)
    assert "nats_reconnected" in logs  # actors on the killed node moved to the other one
    _nothing_refused(cluster)


async def test_every_actor_creating_the_streams_at_once_on_a_fresh_cluster(tmp_path: Path) -> None:
    """Eight clients run the setup at the same moment on a cluster that has just elected its leaders."""
    with NatsCluster(tmp_path / "cluster") as nats:
        from miles.bus.connect import connect

        async def one(i: int) -> None:
            outage = Outage(budget_s=30.0)
            nc = await connect(nats.url, name=f"actor-{i}", outage=outage)
            try:
                js = resilient_jetstream(nc, outage)
                await ensure_run_streams(js, Subjects("fresh"), replicas=3, ack_wait_s=5.0)
            finally:
                await nc.close()

        await asyncio.gather(*(one(i) for i in range(8)))
        nc = await connect(nats.url, name="check")
        try:
            info = await nc.jetstream().stream_info("fresh_TRAJ")
            assert info.config.num_replicas == 3 and info.cluster is not None and len(info.cluster.replicas or []) == 2
        finally:
            await nc.close()


def test_the_controller_killed_three_times(tmp_path: Path, model_cache: Path) -> None:
    """Killed mid-burst (part of a batch published), then twice at random moments: each restart rebuilds its
    state and the record from the streams. summary.json equals the streams' own count, metrics.jsonl has
    each step once, and no group id was ever played under another sample."""
    server = EmbeddedNats(tmp_path / "bus")
    server.start_sync()
    cfg = _run("ctlkill", model_cache, **{"trainer.steps": 10, "eval.every": 3})
    cluster = Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=server.url)
    try:
        cluster.start("controller", "controller", failpoints="issue:7")  # the 7th prompt of the first batch of 8
        cluster.start("rollout-0", "rollout")
        cluster.start("rollout-1", "rollout")
        cluster.start_trainer()
        proc = cluster.procs["controller"]
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.returncode == -9, f"the failpoint never fired:\n{cluster.log('controller')[-2000:]}"
        for life, after_steps in enumerate((3, 6), start=1):
            cluster.start(f"controller-{life}", "controller", "--actor-id", "controller")
            cluster.wait_for(lambda n=after_steps: cluster.steps_recorded() >= n, 240, f"{after_steps} steps")
            time.sleep(0.7 * life)
            cluster.kill(f"controller-{life}")
        cluster.start("controller-3", "controller", "--actor-id", "controller")
        _finish(cluster, server.url, killed=("controller", "controller-1", "controller-2"))
    finally:
        cluster.stop()
        server.stop_sync()
    # The life after the mid-burst kill sent its predecessor's last batch again (the copies the server held
    # were dropped by message id; the streams' accounting above shows none was played under another sample).
    republished = [json.loads(line) for line in cluster.log("controller-1").splitlines() if "batch_republished" in line]
    assert republished and republished[0]["prompts"] >= 1
    lines = [json.loads(line) for line in (cluster.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == sorted(row["step"] for row in lines)
    assert "controller_rebuilt" in cluster.log("controller-3")


async def _newest_snapshot(url: str, cfg: Any) -> ControllerSnapshot | None:
    bus = await Bus.open(cfg.bus, url, cfg.name, "audit", role="controller")
    try:
        return await newest_snapshot(bus)
    finally:
        await bus.close()


def _snapshot_steps(url: str, cfg: Any) -> int:
    """Steps recorded in the newest snapshot on the bus (-1: none yet)."""
    snapshot = asyncio.run(_newest_snapshot(url, cfg))
    return -1 if snapshot is None else len(snapshot.record.steps.steps_above) + snapshot.record.steps.steps_floor


def _monitor_once(cluster: Cluster) -> dict[str, Any]:
    """What ``miles-node --role monitor --json --once`` shows of the run."""
    cmd = node_command(
        "monitor", cluster.config_path, cluster.run_dir / "monitor", cluster.nats_url, "--json", "--once"
    )
    done = subprocess.run(cmd, capture_output=True, timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


async def _purge_to(url: str, cfg: Any, snapshot: ControllerSnapshot) -> dict[str, int]:
    """Purge EVENTS and METRICS of everything the snapshot holds (as stream limits would); returns the first
    sequence each keeps."""
    nc = await nats.connect(url)
    try:
        js, s = nc.jetstream(), Subjects(cfg.name)
        keep = {
            s.metrics_stream: snapshot.positions["metrics"] + 1,
            s.events_stream: min(v for k, v in snapshot.positions.items() if k != "metrics") + 1,
        }
        for stream, first in keep.items():
            await js.purge_stream(stream, seq=first)
            assert (await js.stream_info(stream)).state.first_seq >= first
        return keep
    finally:
        await nc.close()


def test_a_controller_restarted_on_streams_purged_to_its_snapshot(tmp_path: Path, model_cache: Path) -> None:
    """The controller writes a snapshot every 3 steps. With the trainer frozen before its 8th step (of 12), the
    controller is killed once its snapshot of 6 steps is stored, and EVENTS and METRICS are purged of everything
    that snapshot holds. The restarted controller takes the snapshot and the few messages after it: no step
    report refused, no group id issued twice, discards and admission credits exact, and summary.json equals the
    streams (as read before the purge, and after). A monitor attached at the end shows the whole run, as
    summary.json does: the reports and evaluations the purge took are in the snapshot it starts from."""
    server = EmbeddedNats(tmp_path / "bus")
    server.start_sync()
    # The test purges the streams itself (as stream limits would): the actors purge nothing (the harness sets
    # bus.retention all).
    cfg = _run("purged", model_cache, **{"trainer.steps": 12, "eval.every": 4, "bus.snapshot_every_steps": 3})
    cluster = Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=server.url)
    try:
        cluster.start_all(trainer_failpoints=FREEZE_EVERY.format(n=8))  # frozen before step 7 (0-based)
        cluster.wait_stopped("trainer-0", 240, "the trainer's 8th step")
        cluster.wait_for(
            lambda: (
                (snap := asyncio.run(_newest_snapshot(server.url, cfg))) is not None
                and snap.record.steps.steps_floor >= 6
            ),
            60,
            "a snapshot of 6 steps",
        )
        cluster.kill("controller")
        snapshot = asyncio.run(_newest_snapshot(server.url, cfg))
        assert snapshot is not None
        read_before = asyncio.run(read_stream_record(server.url, cfg, role="controller"))
        kept = asyncio.run(_purge_to(server.url, cfg, snapshot))
        cluster.start("controller-1", "controller", "--actor-id", "controller")
        cluster.resume("trainer-0")
        _finish(cluster, server.url, killed=("controller",), read_before=read_before)
        seen = _monitor_once(cluster)  # a monitor attached now: its first reports were purged
    finally:
        cluster.stop()
        server.stop_sync()
    assert all(first > 1 for first in kept.values()), (kept, snapshot.positions)  # the purge took from both
    summary = json.loads((cluster.run_dir / "summary.json").read_text())
    assert seen["steps_seen"] == cfg.trainer.steps
    assert sum(seen["staleness_histogram"].values()) == summary["trajectories_trained"]
    assert seen["staleness_mean"] == round(summary["staleness_mean"], 4)
    assert seen["trained"]["samples"] == summary["samples_trained"]
    evals = [json.loads(line) for line in (cluster.run_dir / "evals.jsonl").read_text().splitlines()]
    assert seen["evals"] == {str(e["step"]): e["eval_accuracy"] for e in evals} and "0" in seen["evals"]
    rebuilt = [json.loads(line) for line in cluster.log("controller-1").splitlines() if "controller_rebuilt" in line]
    assert rebuilt and rebuilt[0]["snapshot_step"] == snapshot.record.steps.steps_floor
    _nothing_refused(cluster)
    lines = [json.loads(line) for line in (cluster.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == list(range(cfg.trainer.steps))


async def _stream_states(url: str, cfg: Any) -> dict[str, Any]:
    nc = await nats.connect(url)
    try:
        js, s = nc.jetstream(), Subjects(cfg.name)
        return {name: (await js.stream_info(name)).state for name in (s.traj_stream, s.events_stream, s.metrics_stream)}
    finally:
        await nc.close()


def test_the_streams_keep_only_what_a_restart_needs(tmp_path: Path, model_cache: Path) -> None:
    """bus.retention recovery (the default), a checkpoint and a controller snapshot every 3 steps of 24: the
    trainer purges the trajectories its oldest kept checkpoint no longer needs, the controller the events and
    metrics its snapshots hold. The trainer freezes itself with 6 and with 13 steps trained: a snapshot is
    written at each stop, and the second purges what the first holds. Then the trainer and the controller are
    both killed and restarted on what is left: the run completes with every step recorded once and nothing
    refused."""
    server = EmbeddedNats(tmp_path / "bus")
    server.start_sync()
    sets = {
        "trainer.steps": 24,
        "eval.every": 8,
        "trainer.checkpoint_every": 3,
        "bus.snapshot_every_steps": 3,
        "bus.retention": "recovery",
    }
    cfg = _run("bounded", model_cache, **sets)
    cluster = Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=server.url)
    try:
        cluster.start_all(trainer_failpoints=FREEZE_EVERY.format(n=7))  # frozen with 6, then 13 steps trained
        with trainer_frozen(cluster, "the trainer's 7th step"):  # a snapshot once 6 steps are recorded
            cluster.wait_for(lambda: _snapshot_steps(server.url, cfg) >= 6, 60, "a snapshot of 6 steps")
        cluster.wait_stopped("trainer-0", 240, "the trainer's 14th step")
        # 13 steps: a second snapshot (the count passed 9 and 12), checkpoints after 3, 6, 9 and 12
        cluster.wait_for(
            lambda: all(state.first_seq > 1 for state in asyncio.run(_stream_states(server.url, cfg)).values()),
            60,
            "every stream purged of its start",
        )
        purged = asyncio.run(_stream_states(server.url, cfg))
        cluster.kill("trainer-0")
        cluster.kill("controller")
        cluster.start("controller-1", "controller", "--actor-id", "controller")
        cluster.start_trainer(suffix="-1")
        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 240, "the end of the run")
        cluster.wait_all_exit(120)
        states = asyncio.run(_stream_states(server.url, cfg))
    finally:
        cluster.stop()
        server.stop_sync()
    for name, proc in cluster.procs.items():
        expected = -9 if name in ("trainer-0", "controller") else 0
        assert proc.returncode == expected, f"{name} exited {proc.returncode}:\n{cluster.log(name)[-2000:]}"
    # each stream went on losing its start after the restarts
    assert all(states[name].first_seq > purged[name].first_seq for name in states), (purged, states)
    assert "trainer_recovering" in cluster.log("trainer-1-0") or "trainer_resumed" in cluster.log("trainer-1-0")
    summary = cluster.summary()
    assert summary["status"] == "complete" and summary["steps"] == cfg.trainer.steps
    _nothing_refused(cluster)
    lines = [json.loads(line) for line in (cluster.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(row["step"] for row in lines) == list(range(cfg.trainer.steps))
    ledger = cluster.ledger()
    issued = [r["group_id"] for r in ledger if r["event"] == "issued"]
    assert len(issued) == len(set(issued)) == summary["groups_issued"]
    trained = [r["group_id"] for r in ledger if r["event"] == "trained"]
    assert len(trained) == len(set(trained)) == summary["trajectories_trained"]
