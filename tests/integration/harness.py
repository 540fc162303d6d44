"""Helpers for end-to-end tests: real nats-server, real ``miles-node`` processes, a run directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from miles.config import RunConfig, dump_config, load_config
from miles.failpoints import ENV as FAILPOINTS_ENV
from miles.launch import node_command
from miles.ports import free_port

M = TypeVar("M")


def process_state(pid: int) -> str:
    """The one-letter state of a live process (``R``, ``S``, ``T`` for stopped, ``Z``...), from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "X"  # gone (reaped)
    return stat[stat.rindex(")") + 2]  # the name in parentheses may hold spaces or parentheses itself


def small_run_config(model_cache: Path, name: str, **overrides: Any) -> RunConfig:
    """A run small enough for CI: tiny model, short warm-up, few steps, quick redelivery."""
    sets = {
        "name": name,
        "model.hidden_size": 32,
        "model.num_layers": 1,
        "model.num_heads": 2,
        "model.warmup_steps": 40,
        "model.cache_dir": str(model_cache),
        "task.max_operand": 9,
        "task.train_size": 300,
        "task.eval_size": 40,
        "rollout.workers": 2,
        "rollout.group_size": 4,
        "rollout.groups_in_flight": 2,
        "rollout.sampling.max_new_tokens": 3,
        "trainer.steps": 6,
        "trainer.groups_per_step": 4,
        "eval.every": 3,
        "trainer.checkpoint_every": 2,
        "staleness.max_staleness": 1,
        "bus.ack_wait_s": 4.0,
        "bus.heartbeat_s": 0.5,
        # Tests audit the whole run from the streams at its end (every announcement, trajectory and discard):
        # nothing is purged unless a test asks for the default (tests of bus.retention: recovery).
        "bus.retention": "all",
    }
    sets.update({k: v for k, v in overrides.items()})
    return load_config(None, [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in sets.items()])


@dataclass
class Cluster:
    """Actor processes of one run, started by hand as ``miles-node`` (what a multi-machine user does)."""

    cfg: RunConfig
    run_dir: Path
    nats_url: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.run_dir / "config.yaml"
        self.config_path.write_text(dump_config(self.cfg))
        self.master_port = free_port()

    def start(
        self, name: str, role: str, *extra: str, nats_url: str | None = None, failpoints: str | None = None
    ) -> subprocess.Popen:
        """``nats_url``: another server than the run's (e.g. a remote fleet's leaf node); ``failpoints``: the
        process' ``MILES_FAILPOINTS`` (miles/failpoints.py)."""
        log = open(self.run_dir / f"{name}.log", "ab")
        url = nats_url or self.nats_url
        cmd = node_command(role, self.config_path, self.run_dir, url, "--actor-id", name, *extra)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop(FAILPOINTS_ENV, None)
        if failpoints:
            env[FAILPOINTS_ENV] = failpoints
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs[name] = proc
        return proc

    def start_trainer(self, ranks: int = 1, suffix: str = "", failpoints: str | None = None) -> None:
        for rank in range(ranks):
            self.start(
                f"trainer{suffix}-{rank}",
                "trainer",
                "--rank",
                str(rank),
                "--world-size",
                str(ranks),
                "--master-port",
                str(self.master_port),
                failpoints=failpoints,
            )

    def start_all(self, rollouts: int = 2, ranks: int = 1, trainer_failpoints: str | None = None) -> None:
        self.start("controller", "controller")
        for i in range(rollouts):
            self.start(f"rollout-{i}", "rollout")
        self.start_trainer(ranks, failpoints=trainer_failpoints)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=30)

    def wait_stopped(self, name: str, timeout_s: float, what: str) -> None:
        """Wait until ``name`` is frozen by SIGSTOP (a ``stop`` failpoint): the state, not a moment, to act in."""
        self.wait_for(lambda: process_state(self.procs[name].pid) == "T", timeout_s, what, poll_s=0.02)
        assert self.procs[name].poll() is None, f"{name} exited instead of stopping at {what}"

    def resume(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGCONT)

    def log(self, name: str) -> str:
        return (self.run_dir / f"{name}.log").read_text(errors="replace")

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5) -> None:
        """Wait until ``predicate()`` holds, failing on an actor that died (not of SIGKILL) meanwhile; ``poll_s``
        small where the test must act within a step or two of the moment (a tiny run's step takes ~50 ms)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            for name, proc in self.procs.items():
                code = proc.poll()
                if code not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(
                        f"{name} exited with {code} while waiting for {what}:\n{self.log(name)[-3000:]}"
                    )
            time.sleep(poll_s)
        tails = "\n".join(f"--- {n}\n{self.log(n)[-1500:]}" for n in self.procs)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{tails}")

    def steps_recorded(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())

    def ledger(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.run_dir / "groups.jsonl").read_text().splitlines()]

    def wait_all_exit(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{name} did not exit after the run:\n{self.log(name)[-2000:]}") from None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


async def subject_messages(url: str, stream: str, subject: str, model: type[M]) -> list[M]:
    """Every message ever published on ``subject`` (kept by ``stream``), decoded as ``model``."""
    from miles.bus.connect import connect
    from miles.bus.schema import decode

    nc = await connect(url, name="audit")
    try:
        js = nc.jetstream()
        sub = await js.subscribe(subject, stream=stream, ordered_consumer=True)
        out: list[M] = []
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except Exception:  # nats TimeoutError: nothing more on the subject
                return out
            out.append(decode(msg.data, model))
    finally:
        await nc.close()


async def traj_groups_by_seq(url: str, run: str) -> dict[int, str]:
    """TRAJ stream sequence -> group id of every trajectory the stream holds."""
    from miles.bus.connect import connect
    from miles.bus.schema import Trajectory, decode

    nc = await connect(url, name="audit")
    try:
        sub = await nc.jetstream().subscribe(f"{run}.traj", stream=f"{run}_TRAJ", ordered_consumer=True)
        out: dict[int, str] = {}
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except Exception:  # nats TimeoutError: nothing more
                return out
            out[msg.metadata.sequence.stream] = decode(msg.data, Trajectory).group_id
    finally:
        await nc.close()


def check_held_weights(cluster: Cluster) -> None:
    """Every version a worker generated a trained token with was reported by that worker, and every
    report matches the trainer's announced digest for its version (read from the streams, so independent
    of when the controller wrote its summary)."""
    import asyncio

    from miles.bus.schema import Trajectory, WeightsAnnounced, WeightsHeld

    run = cluster.cfg.name
    url, events = cluster.nats_url, f"{run}_EVENTS"
    announced = asyncio.run(subject_messages(url, events, f"{run}.events.weights", WeightsAnnounced))
    reports = asyncio.run(subject_messages(url, events, f"{run}.events.weights_held", WeightsHeld))
    trajectories = asyncio.run(subject_messages(url, f"{run}_TRAJ", f"{run}.traj", Trajectory))
    digests = {a.version: a.state_digest for a in announced}
    reported = {(r.worker_id, r.version) for r in reports}
    used = {(t.worker_id, v) for t in trajectories for e in t.episodes for _, v in e.spans}
    assert used and used <= reported, f"versions generated with but never reported: {sorted(used - reported)}"
    for r in reports:
        assert r.state_digest and r.state_digest == digests[r.version], f"{r.worker_id} v{r.version}"
    summary = cluster.summary()
    assert summary["weights_mismatches"] == 0 and summary["weights_verified"] >= 1


def run_to_completion(
    cfg: RunConfig, run_dir: Path, nats_url: str, timeout_s: float = 300, *, ranks: int = 1
) -> Cluster:
    """Controller, two rollout workers and a trainer of ``ranks`` ranks as processes until the run ends; the
    accounting is checked. Returns the (stopped) cluster for its record and logs."""
    from miles.prepare import prepare

    prepare(cfg)  # the model is built once, before any process starts
    cluster = Cluster(cfg=cfg, run_dir=run_dir, nats_url=nats_url)
    try:
        cluster.start_all(rollouts=2, ranks=ranks)
        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), timeout_s, "the end of the run")
        cluster.wait_all_exit(60)
    finally:
        cluster.stop()
    check_accounting(cluster)
    return cluster


def check_accounting(cluster: Cluster) -> dict[str, set[str]]:
    """Every issued group is trained once, filtered, discarded, or still outstanding within the admission window
    (plus the groups a group filter over-issues)."""
    from miles.algo.filters import over_issue_groups

    kinds = ("issued", "trained", "dropped", "requeued", "filtered")
    events: dict[str, set[str]] = {kind: set() for kind in kinds}
    trained_list: list[str] = []
    for row in cluster.ledger():
        events[row["event"]].add(row["group_id"])
        if row["event"] == "trained":
            trained_list.append(row["group_id"])
    assert len(trained_list) == len(set(trained_list)), "a group was trained twice"
    assert events["trained"] <= events["issued"]
    resolved_not_trained = events["dropped"] | events["requeued"] | events["filtered"]
    assert not (events["trained"] & resolved_not_trained)
    assert not (events["filtered"] & (events["dropped"] | events["requeued"])), "a group filtered and discarded"
    outstanding = events["issued"] - events["trained"] - resolved_not_trained
    cfg = cluster.cfg
    extra = over_issue_groups(cfg.trainer.algo, cfg.trainer.groups_per_step)
    assert len(outstanding) <= (cfg.staleness.max_staleness + 1) * cfg.trainer.groups_per_step + extra
    summary = cluster.summary()
    assert summary["groups_issued"] == len(events["issued"])
    assert summary["groups_outstanding"] == len(outstanding)
    return events


@dataclass
class StreamRecord:
    """What the run's own streams say happened, counted independently of the controller's files."""

    issued: dict[str, str]  # group id -> sample id, from the controller's issue records
    issue_records: int
    steps: dict[int, list[str]]  # step -> groups trained into the surviving version of that step
    discarded: dict[str, bool]  # group id -> requeued
    evals: dict[int, float]  # step of the evaluated version -> accuracy
    done_steps: int | None
    tickets: dict[str, set[str]]  # group id -> sample ids of every trajectory's ticket (the prompt as played)
    version_steps: dict[int, int] = field(default_factory=dict)  # announced version -> its step
    read_up_to: dict[str, int] = field(default_factory=dict)  # per subject read: the last sequence

    @property
    def trained(self) -> list[str]:
        return [g for step in sorted(self.steps) for g in self.steps[step]]


async def read_stream_record(
    url: str, cfg: RunConfig, *, role: str = "monitor", after: StreamRecord | None = None
) -> StreamRecord:
    """Read METRICS, EVENTS and TRAJ of ``cfg``'s run (with ``cfg.bus``'s credentials, as ``role``); ``after``: go
    on from a record read earlier (what the streams held then, though they may have purged it since)."""
    from miles.bus.client import Bus
    from miles.bus.follow import stored_messages
    from miles.bus.schema import (
        EvalResult,
        GroupsDiscarded,
        GroupsIssued,
        PromptGroup,
        StepMetrics,
        TrainerDone,
        Trajectory,
        WeightsAnnounced,
        decode,
        decode_any,
    )

    bus = await Bus.open(cfg.bus, url, cfg.name, "audit", role=role)
    s = bus.subjects
    record = after or StreamRecord({}, 0, {}, {}, {}, None, {})
    version_steps, issued, steps, evals = record.version_steps, record.issued, record.steps, record.evals
    discarded, tickets, read_up_to = record.discarded, record.tickets, record.read_up_to

    async def read(stream: str, subject: str) -> AsyncIterator[Any]:
        async for raw in stored_messages(bus.js, stream, subject, after_seq=read_up_to.get(subject, 0)):
            read_up_to[subject] = raw.seq or 0
            yield raw

    try:
        async for raw in read(s.events_stream, s.weights):
            ann = decode(raw.data, WeightsAnnounced)
            version_steps[ann.version] = ann.step
        records = record.issue_records
        done_steps = record.done_steps
        async for raw in read(s.metrics_stream, s.metrics_all):
            msg = decode_any(raw.data)
            if isinstance(msg, GroupsIssued):
                records += 1
                for gid, sid in zip(msg.group_ids, msg.sample_ids, strict=True):
                    assert issued.setdefault(gid, sid) == sid, f"{gid} issued twice with different samples"
            elif isinstance(msg, StepMetrics):
                steps[msg.step] = list(msg.trained_group_ids)  # a replayed step supersedes the lost one
            elif isinstance(msg, EvalResult):
                evals.setdefault(version_steps.get(msg.requested_version, 0), msg.accuracy)
            elif isinstance(msg, TrainerDone):
                done_steps = msg.steps
        async for raw in read(s.events_stream, s.discarded):
            d = decode(raw.data, GroupsDiscarded)
            for gid in d.group_ids:
                assert gid not in discarded, f"{gid} discarded twice"
                discarded[gid] = d.requeue
        if role != "monitor":  # the monitor may not read trajectories
            async for raw in read(s.traj_stream, s.traj):
                traj = decode(raw.data, Trajectory)
                if traj.ticket:
                    tickets.setdefault(traj.group_id, set()).add(decode(traj.ticket, PromptGroup).sample_id)
        return StreamRecord(issued, records, steps, discarded, evals, done_steps, tickets, version_steps, read_up_to)
    finally:
        await bus.close()


def check_stream_accounting(cluster: Cluster, record: StreamRecord) -> None:
    """Server-side accounting: every issued group trained (once), dropped or re-issued, or outstanding within
    the admission window; nothing trained that was not issued; no group id played under another sample; and
    summary.json, metrics.jsonl and the ledger agree with the streams."""
    cfg = cluster.cfg
    trained = record.trained
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert set(trained) <= set(record.issued), "a trained group was never issued"
    assert not set(trained) & set(record.discarded), "a group was both trained and discarded"
    assert set(record.discarded) <= set(record.issued)
    outstanding = set(record.issued) - set(trained) - set(record.discarded)
    assert len(outstanding) <= (cfg.staleness.max_staleness + 1) * cfg.trainer.groups_per_step
    assert sorted(record.steps) == list(range(cfg.trainer.steps)) and record.done_steps == cfg.trainer.steps
    for gid, samples in record.tickets.items():
        assert samples == {record.issued[gid]}, f"{gid} was played as {samples}, issued as {record.issued[gid]}"
    summary = cluster.summary()
    assert summary["status"] == "complete" and summary["steps"] == cfg.trainer.steps
    assert summary["trajectories_trained"] == len(trained)
    assert summary["groups_issued"] == len(record.issued)
    assert summary["groups_outstanding"] == len(outstanding)
    assert summary["trajectories_dropped"] == len(record.discarded)
    assert summary["trajectories_requeued"] == sum(record.discarded.values())
    assert summary["eval_before"] == record.evals.get(0)
    last = max(record.evals)
    assert (summary["eval_after_step"], summary["eval_after"]) == (last, record.evals[last])
    steps_in_file = [json.loads(line)["step"] for line in (cluster.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(steps_in_file) == list(range(cfg.trainer.steps)), f"metrics.jsonl steps: {steps_in_file}"
    ledger = cluster.ledger()
    assert sorted(r["group_id"] for r in ledger if r["event"] == "issued") == sorted(record.issued)
    assert sorted(r["group_id"] for r in ledger if r["event"] == "trained") == sorted(trained)
    assert sorted(r["group_id"] for r in ledger if r["event"] in ("dropped", "requeued")) == sorted(record.discarded)
