"""The scripted controller and trainer side of a conformance session, and what the worker published.

A session drives one rollout worker process (any command line) through the protocol of docs/protocol.md
on a real nats-server: it sets up the run's streams, writes the run info, publishes weight versions (one
of them forged), prompt groups and an evaluation shard (with malformed messages among them), control
messages of another run instance, and finally a valid stop. It records everything the worker put on the
bus; the tests in this package judge the record.

Phases, in order (each waits for the worker, bounded):

1. before the worker starts: streams, a stop of another run instance stored in EVENTS, run info,
   version 0 (the prepared model's weights, perturbed: a worker that generates with its local checkpoint
   is caught by the log-prob check);
2. groups g0, g1 at version 0, a garbage prompt and a schema-1 prompt, an evaluation shard;
3. version 1, a forged version 2 (payload stored, digest announced for other bytes), garbage on the
   announcement subject, version 3, then group g2 issued at version 3;
4. live control messages of another instance (wrong nonce, no nonce, garbage), then group g3 at version 3:
   the worker must still play it;
5. the valid stop: the worker exits 0 with nothing left unacked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch

from miles.bus.client import Bus
from miles.bus.runinfo import RunInfo, build_run_info, new_run_nonce, publish_run_info
from miles.bus.schema import Control, EvalTask, PromptGroup, WeightsAnnounced, encode
from miles.config import RunConfig
from miles.models.loading import load_policy, prepared_model_dir
from miles.sync.checksum import digest
from miles.sync.payload import serialize_state
from miles.sync.precision import state_digest, to_rollout_state
from miles.sync.transport.dataplane import WeightStore
from miles.tasks.registry import build_task

WAIT_S = 120.0
GROUPS_V0 = ("g0", "g1")


class WorkerFailed(Exception):
    """The worker did not do what a phase waits for (exited, or too slow)."""


@dataclass
class Stored:
    """One message as JetStream stored it."""

    subject: str
    data: bytes
    ts: float  # unix seconds the server stored it
    headers: dict[str, str]


@dataclass
class Record:
    """Everything a session saw, for the checks."""

    worker_id: str
    run_nonce: str
    states: dict[int, dict[str, torch.Tensor]]  # version -> published rollout-precision state
    announced: dict[int, str]  # version -> announced state digest (the forged one included)
    forged: int
    issued: dict[str, PromptGroup]
    eval_task: EvalTask
    traj: list[Stored] = field(default_factory=list)
    held: list[Stored] = field(default_factory=list)
    eval_results: list[Stored] = field(default_factory=list)
    dead_letters: list[Stored] = field(default_factory=list)
    heartbeats: list[tuple[float, bytes]] = field(default_factory=list)
    refused_stops_at: float = 0.0
    valid_stop_at: float = 0.0
    exit_code: int | None = None
    exited_at: float = 0.0
    unacked: int = -1
    pending: int = -1
    log_tail: str = ""
    aborted: str = ""  # the phase the worker did not get through (then the checks judge what there is)
    good: list[bytes] = field(default_factory=list)  # every well-formed message of this run instance sent


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The prepared weights plus seeded noise: versions differ from each other and from the checkpoint."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.3 * v.float().std().nan_to_num(0.0) * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
        for k, v in state.items()
    }


class Driver:
    """Plays controller and trainer for one worker under test."""

    def __init__(self, cfg: RunConfig, url: str, worker_cmd: list[str], worker_id: str, log_path: Path) -> None:
        self.cfg = cfg
        self.url = url
        self.worker_cmd = worker_cmd
        self.worker_id = worker_id
        self.log_path = log_path
        self.run = cfg.name
        self.model_dir = prepared_model_dir(cfg.model, cfg.task)
        model, _ = load_policy(self.model_dir)
        self.base = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.samples = build_task(cfg.task).samples("train")

    async def session(self) -> Record:
        bus = await Bus.open(self.cfg.bus, self.url, self.run, "conformance-driver")  # creates the streams
        try:
            return await self._session(bus)
        finally:
            await bus.close()

    async def _session(self, bus: Bus) -> Record:
        s = bus.subjects
        # 1. another instance's stop, stored (EVENTS keeps it 7 days), then this instance's run info and v0
        await bus.publish(s.control, Control(command="stop", reason="an earlier run", run_instance=new_run_nonce()))
        instance = await bus.claim_run_instance()  # the state bucket's run_instance, as the controller does
        info, files = await asyncio.to_thread(build_run_info, self.cfg, self.model_dir, run_nonce=instance)
        info = await publish_run_info(bus.js, info, files)
        self.store = await WeightStore.create(bus.js, self.run, keep_versions=8)
        record = Record(
            worker_id=self.worker_id,
            run_nonce=info.run_nonce,
            states={},
            announced={},
            forged=2,
            issued={},
            eval_task=self._eval_task(),
        )
        await self._publish_version(bus, record, 0)
        beats = await bus.nc.subscribe(s.heartbeat("rollout", self.worker_id))
        collector = asyncio.create_task(_collect(beats, record.heartbeats))
        log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        proc = subprocess.Popen(self.worker_cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        try:
            await self._drive(bus, record, info, proc)
        except WorkerFailed as exc:
            record.aborted = str(exc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collector
            record.log_tail = self.log_path.read_text(errors="replace")[-4000:]
        record.traj = await stored(bus, s.traj_stream, s.traj)
        record.held = await stored(bus, s.events_stream, s.weights_held)
        record.eval_results = await stored(bus, s.events_stream, s.eval_results)
        record.dead_letters = await stored(bus, s.dlq_stream, f"{self.run}.dlq.>")
        consumer = await bus.js.consumer_info(s.prompts_stream, s.ROLLOUT_CONSUMER)
        record.unacked, record.pending = consumer.num_ack_pending, consumer.num_pending
        return record

    async def _drive(self, bus: Bus, record: Record, info: RunInfo, proc: subprocess.Popen) -> None:
        s = bus.subjects
        # 2. work at version 0, with malformed prompts among it
        for gid in GROUPS_V0:
            await self._issue(bus, record, gid, 0)
        await bus.js.publish(s.prompts, b"\x00\xffnot msgpack")
        old = msgpack.packb({"schema": 1, "kind": "prompt_group", "group_id": "g9", "prompt": "1+1="})
        await bus.js.publish(s.prompts, old)
        record.good.append(encode(record.eval_task))
        await bus.publish(s.evalq, record.eval_task)
        await self._until(bus, proc, lambda: self._count(bus, s.traj_stream, s.traj, 2), "trajectories of g0 and g1")
        await self._until(bus, proc, lambda: self._count(bus, s.events_stream, s.eval_results, 1), "the eval result")
        # 3. new versions: 1, a forged 2, garbage, 3; then work that needs 3
        await self._publish_version(bus, record, 1)
        await self._publish_version(bus, record, 2, forge=True)
        await bus.js.publish(s.weights, b"\xc1 garbage announcement")
        await self._publish_version(bus, record, 3)
        await self._issue(bus, record, "g2", 3)
        await self._until(bus, proc, lambda: self._count(bus, s.traj_stream, s.traj, 3), "the trajectory of g2")
        await self._until(bus, proc, lambda: _beat_at(record, 3), "a heartbeat naming version 3")
        # 4. stops of another instance, live, then work that proves the worker is still there
        record.refused_stops_at = time.time()
        await bus.publish(s.control, Control(command="stop", reason="forged", run_instance=new_run_nonce()))
        await bus.publish(s.control, Control(command="stop", reason="no instance"))
        await bus.js.publish(s.control, b"\x93garbage control")
        await asyncio.sleep(1.0)
        await self._issue(bus, record, "g3", 3)
        await self._until(bus, proc, lambda: self._count(bus, s.traj_stream, s.traj, 4), "the trajectory of g3")
        # 5. this instance's stop
        record.valid_stop_at = time.time()
        stop = Control(command="stop", reason="conformance done", run_instance=info.run_nonce)
        record.good.append(encode(stop))
        await bus.publish(s.control, stop)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        record.exit_code = proc.poll()
        record.exited_at = time.time()

    # ------------------------------------------------------------------ publishing

    async def _publish_version(self, bus: Bus, record: Record, version: int, *, forge: bool = False) -> None:
        state = to_rollout_state(perturbed(self.base, 1000 + version), self.cfg.sync.dtype)
        payload = serialize_state(state, version)
        stored_info = await self.store.put(version, payload)
        announced_digest = digest(payload + b"tampered") if forge else stored_info.digest
        ann = WeightsAnnounced(
            version=version,
            step=version,
            digest=announced_digest,
            size=stored_info.size,
            chunks=stored_info.chunks,
            state_digest=state_digest(state),
            precision=self.cfg.sync.dtype,
        )
        record.states[version] = state
        record.announced[version] = ann.state_digest
        if not forge:
            record.good.append(encode(ann))
        await bus.publish(bus.subjects.weights, ann)
        if not forge:
            await bus.put_int("trainer_version", version)

    async def _issue(self, bus: Bus, record: Record, group_id: str, version: int) -> None:
        index = int(group_id[1:])
        sample = self.samples[index]
        group = PromptGroup(
            group_id=group_id,
            sample_id=sample.id,
            prompt=sample.prompt,
            answer=sample.answer,
            meta=sample.meta,
            group_size=self.cfg.rollout.group_size,
            issue_index=index,
            issued_at_version=version,
        )
        record.issued[group_id] = group
        record.good.append(encode(group))
        await bus.publish(bus.subjects.prompts, group)

    def _eval_task(self) -> EvalTask:
        samples = [
            {"sample_id": x.id, "prompt": x.prompt, "answer": x.answer, "meta": x.meta} for x in self.samples[:3]
        ]
        return EvalTask(eval_id="v0", version=0, shard=0, shards=1, samples=samples, max_new_tokens=3)

    # ------------------------------------------------------------------ waiting

    async def _count(self, bus: Bus, stream: str, subject: str, at_least: int) -> bool:
        info = await bus.js.stream_info(stream, subjects_filter=subject)
        return sum((info.state.subjects or {}).values()) >= at_least

    async def _until(self, bus: Bus, proc: subprocess.Popen, check: Callable[[], Any], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if await check():
                return
            if proc.poll() is not None:
                raise WorkerFailed(f"the worker exited ({proc.returncode}) before {what}:\n{self._tail()}")
            await asyncio.sleep(0.2)
        raise WorkerFailed(f"timed out after {WAIT_S:.0f}s waiting for {what}:\n{self._tail()}")

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


async def _beat_at(record: Record, version: int) -> bool:
    """Whether a heartbeat of the worker named ``version`` (decoded leniently: the checks judge its form)."""
    for _, data in record.heartbeats:
        with contextlib.suppress(Exception):
            if msgpack.unpackb(data).get("version") == version:
                return True
    return False


async def _collect(sub: Any, out: list[tuple[float, bytes]]) -> None:
    while True:
        try:
            msg = await sub.next_msg(timeout=1.0)
        except asyncio.TimeoutError:
            continue
        out.append((time.time(), msg.data))


async def stored(bus: Bus, stream: str, subject: str) -> list[Stored]:
    """Every message of ``subject`` (wildcards allowed) that ``stream`` holds, in order."""
    out: list[Stored] = []
    seq = 0
    while True:
        try:
            msg = await bus.js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
        except Exception:  # nats-py NotFoundError: nothing after seq
            return out
        seq = msg.seq or seq + 1
        headers = {k: str(v) for k, v in (msg.headers or {}).items()}
        ts = msg.time.timestamp() if getattr(msg, "time", None) else 0.0
        out.append(Stored(subject=msg.subject or "", data=msg.data or b"", ts=ts, headers=headers))
