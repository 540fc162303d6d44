"""Controller: feeds prompt groups under the staleness bound, keeps the registry, records the run.

Admission (AReaL-style credits): with trainer version ``v``, ``B = groups_per_step`` and
``eta = max_staleness``, a group is issued only while ``issued - discarded < (eta + v + 1) * B``.
A worker generates a group with a policy version >= the version it was issued at, and the trainer
consumes groups in batches of ``B``, so a trained group is at most ``eta`` versions old; the
trainer re-checks on consumption because arrival order is not issue order.

The controller's own state (issued count, dataset cursor, re-issue queue) lives in the run's KV
bucket and its inputs come from durable consumers, so a restarted controller carries on.

It also audits weight sync (:mod:`miles.actors.weight_audit`): each worker's ``weights_held`` report
is checked against the state digest the trainer announced for that version, and a worker holding
other weights is flagged (``weights_mismatch`` error event, heartbeat stats, summary.json).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from miles.actors.base import Actor
from miles.actors.run_record import RunRecord
from miles.actors.weight_audit import WeightAudit
from miles.bus.client import KEY_STATUS, Bus, messages_until
from miles.bus.schema import (
    Control,
    EvalResult,
    GroupsDiscarded,
    Heartbeat,
    PromptGroup,
    SchemaError,
    StepMetrics,
    TrainerDone,
    WeightsAnnounced,
    WeightsHeld,
    decode_any,
)
from miles.tasks.base import Sample

KEY_CONTROLLER = "controller_state"


@dataclass(slots=True)
class AdmissionState:
    """What the controller must remember across restarts (stored as JSON in the KV bucket)."""

    issued: int = 0  # groups ever issued, re-issues included
    discarded: int = 0  # groups the trainer rejected as too stale (they free their credit)
    cursor: int = 0  # position in the endless shuffled stream of train samples
    reissue: list[str] = field(default_factory=list)  # sample ids waiting to be issued again


def admission_limit(version: int, max_staleness: int, groups_per_step: int, steps: int) -> int:
    """Groups that may be outstanding-or-trained at trainer ``version``: ``(eta + v + 1) * B``, capped."""
    return min((max_staleness + version + 1) * groups_per_step, steps * groups_per_step)


class Controller(Actor):
    role = "controller"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = AdmissionState()
        self.trainer_version = 0
        self.workers: dict[str, Heartbeat] = {}
        self._wake = asyncio.Event()
        self.record = RunRecord(self.run_dir)
        self._epoch_order: tuple[int, list[str]] = (-1, [])
        self.audit = WeightAudit(logger=self.log)
        # mode -> {versions, bytes, max} of the announced payloads (running totals: bounded for any run length)
        self.sync_bytes: dict[str, dict[str, int]] = {}

    def heartbeat(self) -> Heartbeat:
        stats = {
            "issued": float(self.state.issued),
            "discarded": float(self.state.discarded),
            "dead_lettered": float(self.bus.dead_lettered),
            **self.audit.stats(),
        }
        return Heartbeat(role=self.role, actor_id=self.actor_id, version=self.trainer_version, stats=stats)

    async def main(self) -> None:
        from miles.tasks.registry import build_task

        task = build_task(self.cfg.task)
        self.samples = {s.id: s for s in task.samples("train")}
        self.order = list(self.samples)
        raw = await self.bus.get_str(KEY_CONTROLLER)
        if raw:
            self.state = AdmissionState(**json.loads(raw))
            self.log.info("controller_resumed", **asdict(self.state))
        await self.bus.put_str(KEY_STATUS, "running")
        done = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._follow_versions(done), name="controller.versions")
            tg.create_task(self._follow_heartbeats(done), name="controller.heartbeats")
            tg.create_task(self._follow_discards(done), name="controller.discards")
            tg.create_task(self._follow_metrics(done), name="controller.metrics")
            tg.create_task(self._follow_weights_held(done), name="controller.weights_held")
            tg.create_task(self._admit(done), name="controller.admission")
            stop_waiter = tg.create_task(self.stopping.wait(), name="controller.stop")
            await asyncio.wait([stop_waiter, tg.create_task(done.wait())], return_when=asyncio.FIRST_COMPLETED)
            done.set()
            stop_waiter.cancel()

    # ------------------------------------------------------------------ admission

    def _next_sample(self) -> tuple[Sample, bool]:
        """The next prompt (re-issues first) and whether it is a re-issue."""
        if self.state.reissue:
            return self.samples[self.state.reissue.pop(0)], True
        epoch, index = divmod(self.state.cursor, len(self.order))
        self.state.cursor += 1
        if self._epoch_order[0] != epoch:  # one deterministic shuffle per pass over the data
            order = list(self.order)
            random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self.samples[self._epoch_order[1][index]], False

    async def _admit(self, done: asyncio.Event) -> None:
        trainer = self.cfg.trainer
        while not done.is_set():
            self._wake.clear()  # before reading the version: a bump from here on wakes the wait below
            limit = admission_limit(
                self.trainer_version, self.cfg.staleness.max_staleness, trainer.groups_per_step, trainer.steps
            )
            issued_any = False
            while self.state.issued - self.state.discarded < limit and not done.is_set():
                sample, reissue = self._next_sample()
                group = PromptGroup(
                    group_id=f"g{self.state.issued}",
                    sample_id=sample.id,
                    prompt=sample.prompt,
                    answer=sample.answer,
                    group_size=self.cfg.rollout.group_size,
                    issue_index=self.state.issued,
                    issued_at_version=self.trainer_version,
                    attempt=int(reissue),
                )
                await self.bus.publish(self.bus.subjects.prompts, group)
                self.record.ledger("issued", group_id=group.group_id, sample_id=sample.id, version=self.trainer_version)
                self.state.issued += 1
                issued_any = True
            if issued_any:
                await self.bus.put_str(KEY_CONTROLLER, json.dumps(asdict(self.state)))
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------------ inputs

    async def _follow_versions(self, done: asyncio.Event) -> None:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        sub = await self.bus.js.subscribe(self.bus.subjects.weights, ordered_consumer=True, config=config)
        async for msg in messages_until(sub, done):
            ann = await self.bus.decode_or_dead_letter(msg, WeightsAnnounced)
            if ann is None:
                continue
            self.audit.announce(ann)
            totals = self.sync_bytes.setdefault(ann.mode, {"versions": 0, "bytes": 0, "max": 0})
            totals["versions"] += 1
            totals["bytes"] += ann.size
            totals["max"] = max(totals["max"], ann.size)
            if ann.version > self.trainer_version:
                self.trainer_version = ann.version
                self._wake.set()

    async def _follow_heartbeats(self, done: asyncio.Event) -> None:
        sub = await self.bus.nc.subscribe(self.bus.subjects.heartbeat("*", "*"))
        async for msg in messages_until(sub, done):
            hb = await self.bus.decode_or_dead_letter(msg, Heartbeat)
            if hb is not None and hb.role == "rollout":
                self.workers[hb.actor_id] = hb

    async def _pull_loop(
        self, stream: str, durable: str, filter_subject: str, done: asyncio.Event, handle: Any
    ) -> None:
        messages = pull_messages(self.bus, stream, durable, filter_subject, done, ack_wait_s=self.cfg.bus.ack_wait_s)
        async with contextlib.aclosing(messages):
            async for m in messages:
                try:
                    message = decode_any(m.data)
                except SchemaError as exc:
                    await self.bus.dead_letter(m.subject, m.data, str(exc))
                    await m.ack()
                    continue
                await handle(message, done)
                await m.ack()

    async def _follow_discards(self, done: asyncio.Event) -> None:
        async def handle(message: Any, _: asyncio.Event) -> None:
            if not isinstance(message, GroupsDiscarded):
                return
            self.state.discarded += len(message.group_ids)
            for gid, sid in zip(message.group_ids, message.sample_ids, strict=True):
                self.record.ledger(
                    "requeued" if message.requeue else "dropped",
                    group_id=gid,
                    sample_id=sid,
                    trainer_version=message.trainer_version,
                )
                if message.requeue and sid in self.samples:
                    self.state.reissue.append(sid)
            self.record.count_discarded(len(message.group_ids), message.requeue)
            await self.bus.put_str(KEY_CONTROLLER, json.dumps(asdict(self.state)))
            self._wake.set()

        await self._pull_loop(
            self.bus.subjects.events_stream,
            self.bus.subjects.CONTROLLER_EVENTS_CONSUMER,
            self.bus.subjects.discarded,
            done,
            handle,
        )

    async def _follow_metrics(self, done: asyncio.Event) -> None:
        async def handle(message: Any, finished: asyncio.Event) -> None:
            if isinstance(message, StepMetrics):
                lags = [self.trainer_version - hb.version for hb in self.workers.values() if hb.version >= 0]
                self.record.step(message, worker_lag_mean=sum(lags) / len(lags) if lags else 0.0)
            elif isinstance(message, EvalResult):
                self.record.eval(message)
            elif isinstance(message, TrainerDone):
                await self._finish(message)
                finished.set()

        await self._pull_loop(
            self.bus.subjects.metrics_stream,
            self.bus.subjects.CONTROLLER_METRICS_CONSUMER,
            self.bus.subjects.metrics_all,
            done,
            handle,
        )

    async def _follow_weights_held(self, done: asyncio.Event) -> None:
        """Feed every worker's ``weights_held`` report to the audit (durable: none is missed while we run)."""
        await follow_weights_held(self.bus, self.audit, done, ack_wait_s=self.cfg.bus.ack_wait_s)

    async def _write_plots(self) -> None:
        """reward.png and staleness.png in the run directory; a failure is logged, never fatal."""
        if not self.cfg.monitor.plots:
            return
        from miles.monitoring.plots import write_plots

        try:
            paths = await asyncio.to_thread(
                write_plots,
                self.run_dir,
                max_staleness=self.cfg.staleness.max_staleness,
                evals=dict(self.record.evals),
                run_name=self.cfg.name,
            )
        except Exception as exc:  # matplotlib missing, a full disk, a bad line: the run itself is fine
            self.log.warning("plots_failed", error=repr(exc))
        else:
            self.log.info("plots_written", paths=[str(p) for p in paths])

    async def _finish(self, done: TrainerDone) -> None:
        outstanding = self.state.issued - self.state.discarded - self.record.groups_trained
        summary = self.record.write_summary(
            steps=done.steps,
            dead_lettered=await self.bus.dead_letter_count(),
            groups_issued=self.state.issued,
            groups_outstanding=outstanding,
            workers={k: hb.version for k, hb in self.workers.items()},
            # Bytes each published version put on the bus, per sync mode (a delta run also has full anchors).
            sync_bytes={
                mode: {"versions": t["versions"], "mean": t["bytes"] / t["versions"], "max": t["max"]}
                for mode, t in self.sync_bytes.items()
            },
            **self.audit.summary(),
        )
        await self._write_plots()
        await self.bus.put_str(KEY_STATUS, "done")
        await self.bus.publish(self.bus.subjects.control, Control(command="stop", reason="run complete"))
        self.log.info("run_complete", **{k: v for k, v in summary.items() if not isinstance(v, dict)})


async def pull_messages(
    bus: Bus, stream: str, durable: str, subject: str, done: asyncio.Event, *, ack_wait_s: float
) -> AsyncIterator[Msg]:
    """Every message of the durable pull consumer ``durable`` on ``subject`` until ``done`` (the caller
    acks). Creating the consumer is idempotent, so a restarted controller resumes where it stopped."""
    config = ConsumerConfig(durable_name=durable, filter_subject=subject, ack_wait=ack_wait_s)
    sub = await bus.js.pull_subscribe(subject, durable=durable, stream=stream, config=config)
    try:
        while not done.is_set():
            try:
                msgs = await sub.fetch(64, timeout=0.5)
            except asyncio.TimeoutError:
                continue
            for m in msgs:
                yield m
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def follow_weights_held(bus: Bus, audit: WeightAudit, done: asyncio.Event, *, ack_wait_s: float) -> None:
    """Pull ``<run>.events.weights_held`` through the controller's durable consumer into ``audit``.

    Anything that is not a ``weights_held`` message is dead-lettered (and acked); a report is acked
    once the audit has seen it.
    """
    s = bus.subjects
    messages = pull_messages(
        bus, s.events_stream, s.CONTROLLER_WEIGHTS_CONSUMER, s.weights_held, done, ack_wait_s=ack_wait_s
    )
    async with contextlib.aclosing(messages):
        async for m in messages:
            held = await bus.decode_or_dead_letter(m, WeightsHeld)  # acks what it dead-letters
            if held is not None:
                audit.report(held)
                await m.ack()
