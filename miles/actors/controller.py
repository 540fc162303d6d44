"""Controller: feeds prompt groups under the staleness bound, schedules evaluations, records the run.

Admission (AReaL-style credits): with the trainer at lineage step ``s`` (the step of its newest announced
version), ``B = groups_per_step`` and ``eta = max_staleness``, a group is issued only while
``issued - discarded < (eta + s + 1) * B``. A worker plays a group with a policy version >= the version it
was issued at, and the trainer consumes groups in batches of ``B``, so a trained group is at most ``eta``
steps old; the trainer re-checks on consumption because arrival order is not issue order. Versions are
unique ids (a trainer restart supersedes versions with new numbers), so the bound counts steps, which every
announcement carries, not version numbers.

The controller's own state (issued count, dataset cursor, re-issue queue) lives in the run's KV bucket
and its inputs come from durable consumers, so a restarted controller carries on.

It also audits weight sync (:mod:`miles.actors.weight_audit`) and owns held-out evaluation
(:mod:`miles.actors.evaluations`): the first version is evaluated before any prompt is issued, so
``eval_before`` is exactly the initial policy's, and the last one after the trainer is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from nats.aio.msg import Msg

from miles.actors import trust
from miles.actors.base import Actor
from miles.actors.evaluations import EvalCoordinator
from miles.actors.run_record import RunRecord
from miles.actors.weight_audit import WeightAudit
from miles.bus.client import KEY_GROUPS_ISSUED, KEY_STATUS, Bus, messages_until
from miles.bus.dataplane import WeightStore
from miles.bus.errors import PayloadMissing
from miles.bus.follow import follow
from miles.bus.schema import (
    Control,
    EvalResult,
    EvalShardResult,
    GroupsDiscarded,
    Heartbeat,
    Message,
    PromptGroup,
    StepMetrics,
    TrainerDone,
    WeightsAnnounced,
    WeightsHeld,
)
from miles.tasks.base import Sample
from miles.training.lineage import IndexSet

KEY_CONTROLLER = "controller_state"
KEEP_VERSIONS = 256  # version -> step entries remembered (lags of workers a few versions behind)
VERSION_WAIT_S = 10.0  # how long a step report or trainer_done may overtake its announcement
WORKER_TIMEOUT_S = 60.0  # a rollout worker unheard of for this long is no longer live


@dataclass(slots=True)
class AdmissionState:
    """What the controller must remember across restarts (stored as JSON in the KV bucket)."""

    issued: int = 0  # groups ever issued, re-issues included
    discarded: int = 0  # groups the trainer rejected (they free their credit)
    cursor: int = 0  # position in the endless shuffled stream of train samples
    reissue: list[str] = field(default_factory=list)  # sample ids waiting to be issued again
    attempts: dict[str, int] = field(default_factory=dict)  # sample id -> re-issues so far (bounded by reissue)
    resolved: dict[str, Any] = field(default_factory=lambda: IndexSet().to_json())  # issue indices trained or discarded


def admission_limit(step: int, max_staleness: int, groups_per_step: int, steps: int) -> int:
    """Groups that may be outstanding-or-trained with the trainer at ``step``: ``(eta + s + 1) * B``, capped."""
    return min((max_staleness + step + 1) * groups_per_step, steps * groups_per_step)


class Controller(Actor):
    role = "controller"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = AdmissionState()
        self.trainer_version = -1
        self.trainer_step = 0
        self.version_steps: OrderedDict[int, int] = OrderedDict()  # announced version -> its lineage step
        self._version_changed = asyncio.Condition()
        self.workers: dict[str, Heartbeat] = {}  # live rollout workers' latest heartbeats
        self.peers: dict[str, Heartbeat] = {}  # every other actor's latest heartbeat (their refusal counts)
        self.resolved = IndexSet()
        self._wake = asyncio.Event()
        self._admit_open = asyncio.Event()  # set once the initial evaluation is in (or on a resumed run)
        self.record = RunRecord(
            self.run_dir, run_name=self.cfg.name, wandb=self.cfg.monitor.wandb, config=self.cfg.model_dump(mode="json")
        )
        self._epoch_order: tuple[int, list[str]] = (-1, [])
        self.audit = WeightAudit(logger=self.log)
        # mode -> {versions, bytes, max} of the announced payloads (running totals: bounded for any run length)
        self.sync_bytes: dict[str, dict[str, int]] = {}

    def heartbeat(self) -> Heartbeat:
        stats = {
            "issued": float(self.state.issued),
            "discarded": float(self.state.discarded),
            "trainer_step": float(self.trainer_step),
            **self.bus.refusal_stats(),
            **self.audit.stats(),
        }
        if hasattr(self, "evals"):
            stats |= self.evals.stats()
        return Heartbeat(role=self.role, actor_id=self.actor_id, version=self.trainer_version, stats=stats)

    async def main(self) -> None:
        from miles.tasks.registry import build_task

        cfg = self.cfg
        task = build_task(cfg.task, sandbox=cfg.rollout.sandbox)
        self.samples = {s.id: s for s in task.samples("train")}
        self.order = list(self.samples)
        held_out = task.samples("eval")[: cfg.eval.max_samples]
        self.evals = EvalCoordinator(
            self.bus,
            held_out,
            every=cfg.eval.every,
            shard_size=cfg.eval.shard_size,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens,
        )
        self.run_instance = await self.bus.claim_run_instance()
        # The data plane, read-only: an announced version is believed only if its payload is there.
        self.weights = await WeightStore.create(self.bus.js, self.bus.subjects.run, ensure=False)
        self.weights_delta = self.weights.sibling("delta")
        raw = await self.bus.get_str(KEY_CONTROLLER)
        if raw:
            self.state = AdmissionState(**json.loads(raw))
            self.resolved = IndexSet.from_json(self.state.resolved)
            self._admit_open.set()  # the initial evaluation happened before the first issue
            self.log.info("controller_resumed", issued=self.state.issued, cursor=self.state.cursor)
        await self.bus.put_str(KEY_STATUS, "running")
        done = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            self._tasks = tg  # one-off tasks (the initial evaluation, the end of the run) are supervised here too
            tg.create_task(self._follow_versions(done), name="controller.versions")
            tg.create_task(self._follow_heartbeats(done), name="controller.heartbeats")
            tg.create_task(self._follow_discards(done), name="controller.discards")
            tg.create_task(self._follow_metrics(done), name="controller.metrics")
            tg.create_task(self._follow_weights_held(done), name="controller.weights_held")
            tg.create_task(self._follow_eval_results(done), name="controller.eval_results")
            tg.create_task(self._admit(done), name="controller.admission")
            stop_waiter = tg.create_task(self.stopping.wait(), name="controller.stop")
            await asyncio.wait([stop_waiter, tg.create_task(done.wait())], return_when=asyncio.FIRST_COMPLETED)
            done.set()
            stop_waiter.cancel()
        await asyncio.to_thread(self.record.close)  # idempotent: also after a stop before the end

    # ------------------------------------------------------------------ admission

    def _next_sample(self) -> tuple[Sample, int]:
        """The next prompt (re-issues first) and its attempt number."""
        if self.state.reissue:
            sample_id = self.state.reissue.pop(0)
            attempt = self.state.attempts.pop(sample_id, 1)
            return self.samples[sample_id], attempt
        epoch, index = divmod(self.state.cursor, len(self.order))
        self.state.cursor += 1
        if self._epoch_order[0] != epoch:  # one deterministic shuffle per pass over the data
            order = list(self.order)
            random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self.samples[self._epoch_order[1][index]], 0

    async def _admit(self, done: asyncio.Event) -> None:
        trainer = self.cfg.trainer
        while not self._admit_open.is_set() and not done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._admit_open.wait(), timeout=0.5)
        while not done.is_set():
            self._wake.clear()  # before reading the step: a bump from here on wakes the wait below
            limit = admission_limit(
                self.trainer_step, self.cfg.staleness.max_staleness, trainer.groups_per_step, trainer.steps
            )
            issued_any = False
            window = self.state.issued + max(0, limit - (self.state.issued - self.state.discarded))
            if window > self.state.issued and self.trainer_version >= 0:
                # Open the trainer's issue window before the prompts go out: their trajectories can be back
                # before this batch ends, and one past the window is refused as never issued.
                await self.bus.put_int(KEY_GROUPS_ISSUED, window)
            while self.state.issued < window and not done.is_set() and self.trainer_version >= 0:
                sample, attempt = self._next_sample()
                group = PromptGroup(
                    group_id=f"g{self.state.issued}",
                    sample_id=sample.id,
                    prompt=sample.prompt,
                    answer=sample.answer,
                    meta=sample.meta,
                    group_size=self.cfg.rollout.group_size,
                    issue_index=self.state.issued,
                    issued_at_version=self.trainer_version,
                    attempt=attempt,
                )
                await self.bus.publish(self.bus.subjects.prompts, group)
                self.record.ledger("issued", group_id=group.group_id, sample_id=sample.id, version=self.trainer_version)
                self.state.issued += 1
                issued_any = True
            if issued_any:
                await self._save_state()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)

    # ------------------------------------------------------------------ inputs

    async def _save_state(self) -> None:
        self.state.resolved = self.resolved.to_json()
        await self.bus.put_str(KEY_CONTROLLER, json.dumps(asdict(self.state)))

    async def _follow_versions(self, done: asyncio.Event) -> None:
        """Take the trainer's version from its announcements, newest first, then every new one in order."""
        s = self.bus.subjects
        async for raw in follow(self.bus.nc, self.bus.js, s.events_stream, s.weights, done, start="last"):
            ann = await self.bus.accept(raw, WeightsAnnounced)
            if ann is None or ann.version <= self.trainer_version:
                continue  # refused, or a version seen already (a replayed older announcement changes nothing)
            refusal = trust.announcement_refusal(
                ann, newest=self.trainer_version, max_steps=self.cfg.trainer.steps, stored=await self._stored(ann)
            )
            if refusal is not None:
                await self.bus.refuse(raw, f"weights_announced: {refusal}", category="untrusted")
                continue
            await self._adopt(ann, done)

    async def _stored(self, ann: WeightsAnnounced) -> tuple[str, int] | None | bool:
        """What the data plane holds for ``ann``'s version (see :func:`trust.announcement_refusal`)."""
        if ann.transport != "bus":
            return True  # fs or broadcast: nothing on the bus to look up (the signature vouches for it)
        store = self.weights_delta if ann.mode == "delta" else self.weights
        try:
            info = await store.info(ann.version)
        except PayloadMissing:
            return None
        return info.digest, info.size

    async def _adopt(self, ann: WeightsAnnounced, done: asyncio.Event) -> None:
        self.audit.announce(ann)
        totals = self.sync_bytes.setdefault(ann.mode, {"versions": 0, "bytes": 0, "max": 0})
        totals["versions"] += 1
        totals["bytes"] += ann.size
        totals["max"] = max(totals["max"], ann.size)
        self.version_steps[ann.version] = ann.step
        while len(self.version_steps) > KEEP_VERSIONS:
            self.version_steps.popitem(last=False)
        first = self.trainer_version < 0
        self.trainer_version, self.trainer_step = ann.version, ann.step
        async with self._version_changed:
            self._version_changed.notify_all()
        self._wake.set()
        if first and not self._admit_open.is_set():
            self._tasks.create_task(self._initial_eval(ann.version, done), name="controller.initial_eval")
        elif not ann.replayed and self.evals.due(ann.step, self.cfg.trainer.steps) and ann.step > 0:
            await self.evals.request(ann.version)

    async def _announced(self, version: int) -> None:
        """Wait (bounded) for ``version``'s announcement: a step report can overtake it (two readers)."""
        async with self._version_changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    self._version_changed.wait_for(lambda: self.trainer_version >= version), VERSION_WAIT_S
                )

    async def _initial_eval(self, version: int, done: asyncio.Event) -> None:
        """Evaluate the initial policy before any prompt goes out, so eval_before is exactly its accuracy
        (or until the run ends first)."""
        try:
            eval_id = await self.evals.request(version)
            waits = [asyncio.ensure_future(self.evals.wait(eval_id)), asyncio.ensure_future(done.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        finally:
            self._admit_open.set()

    async def _follow_heartbeats(self, done: asyncio.Event) -> None:
        sub = await self.bus.nc.subscribe(self.bus.subjects.heartbeat("*", "*"))
        async for msg in messages_until(sub, done):
            hb = await self.bus.accept(msg, Heartbeat)
            if hb is None:
                continue
            refusal = trust.heartbeat_refusal(hb, msg.subject, run=self.bus.subjects.run, newest=self.trainer_version)
            if refusal is not None:
                await self.bus.refuse(msg, f"heartbeat: {refusal}", category="untrusted")
            elif hb.role == "rollout":
                self.workers[hb.actor_id] = hb
            elif hb.actor_id != self.actor_id:
                self.peers[hb.actor_id] = hb

    async def _heard_from(self, worker_id: str) -> None:
        """Wait (a few heartbeat periods at most) for a worker's heartbeat: after a controller start, reports
        kept by the durable consumer arrive before the workers' next heartbeats do."""
        deadline = time.monotonic() + 3 * self.cfg.bus.heartbeat_s + 1.0
        while worker_id not in self.live_workers() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def live_workers(self) -> set[str]:
        now = time.time()
        return {w for w, hb in self.workers.items() if now - hb.ts < WORKER_TIMEOUT_S}

    async def _pull_loop(
        self,
        durable: str,
        stream: str,
        done: asyncio.Event,
        handle: Callable[[Msg, Message], Awaitable[str | None]],
    ) -> None:
        """Every message of one of the controller's durables: accepted (decoded, verified), handled, acked;
        a handler's refusal (its reason) is dead-lettered instead."""
        messages = pull_messages(self.bus, stream, durable, done)
        async with contextlib.aclosing(messages):
            async for m in messages:
                message = await self.bus.accept_any(m)  # acks what it refuses
                if message is None:
                    continue
                refusal = await handle(m, message)
                if refusal is not None:
                    await self.bus.refuse(m, f"{message.KIND}: {refusal}", category="untrusted")
                else:
                    await m.ack()

    async def _follow_discards(self, done: asyncio.Event) -> None:
        async def handle(m: Msg, message: Message) -> str | None:
            if not isinstance(message, GroupsDiscarded):
                return f"not a groups_discarded on {m.subject}"
            refusal = trust.discard_refusal(message, issued=self.state.issued, resolved=self.resolved)
            if refusal is not None:
                return refusal
            self.state.discarded += len(message.group_ids)
            for gid, sid in zip(message.group_ids, message.sample_ids, strict=True):
                self.resolved.add(int(gid[1:]))
                self.record.ledger(
                    "requeued" if message.requeue else "dropped",
                    group_id=gid,
                    sample_id=sid,
                    trainer_version=message.trainer_version,
                    reason=message.reason,
                )
                if message.requeue and sid in self.samples:
                    self.state.reissue.append(sid)
                    self.state.attempts[sid] = self.state.attempts.get(sid, 0) + 1
            self.record.count_discarded(len(message.group_ids), message.requeue, message.reason)
            await self._save_state()
            self._wake.set()
            return None

        s = self.bus.subjects
        await self._pull_loop(s.CONTROLLER_EVENTS_CONSUMER, s.events_stream, done, handle)

    async def _follow_metrics(self, done: asyncio.Event) -> None:
        async def handle(m: Msg, message: Message) -> str | None:
            if isinstance(message, StepMetrics):
                await self._announced(message.policy_version)
                refusal = trust.step_refusal(message, version_steps=self.version_steps, recorded=self.record.steps_seen)
                if refusal is not None:
                    return refusal
                lags = [
                    message.step - self.version_steps[hb.version]
                    for hb in self.workers.values()
                    if hb.version in self.version_steps
                ]
                for gid in message.trained_group_ids:
                    self.resolved.add(int(gid[1:]))
                self.record.step(message, worker_lag_mean=sum(lags) / len(lags) if lags else 0.0)
            elif isinstance(message, TrainerDone):
                await self._announced(message.policy_version)
                refusal = trust.done_refusal(message, version_steps=self.version_steps, steps=self.cfg.trainer.steps)
                if refusal is not None:
                    return refusal
                self._tasks.create_task(self._finish(message, done), name="controller.finish")
            elif not isinstance(message, EvalResult):  # evaluations are recorded where they are computed
                return f"not a metrics message on {m.subject}"
            return None

        s = self.bus.subjects
        await self._pull_loop(s.CONTROLLER_METRICS_CONSUMER, s.metrics_stream, done, handle)

    async def _follow_eval_results(self, done: asyncio.Event) -> None:
        async def handle(m: Msg, message: Message) -> str | None:
            if not isinstance(message, EvalShardResult):
                return f"not an eval_shard_result on {m.subject}"
            refusal = self.evals.refusal(message)
            if refusal is not None:
                return refusal
            result = await self.evals.on_result(message)
            if result is not None:
                self.record.eval(result, step=self.version_steps.get(result.requested_version, 0))
            return None

        s = self.bus.subjects
        await self._pull_loop(s.CONTROLLER_EVAL_CONSUMER, s.events_stream, done, handle)

    async def _follow_weights_held(self, done: asyncio.Event) -> None:
        """Feed every live worker's ``weights_held`` report to the audit (durable: none is missed while we run)."""

        async def handle(m: Msg, message: Message) -> str | None:
            if not isinstance(message, WeightsHeld):
                return f"not a weights_held on {m.subject}"
            await self._heard_from(message.worker_id)
            refusal = trust.held_refusal(message, workers=self.live_workers(), newest=self.trainer_version)
            if refusal is not None:
                return refusal
            self.audit.report(message)
            return None

        s = self.bus.subjects
        await self._pull_loop(s.CONTROLLER_WEIGHTS_CONSUMER, s.events_stream, done, handle)

    # ------------------------------------------------------------------ the end

    async def _write_plots(self) -> None:
        """reward.png, staleness.png and lengths.png in the run directory; a failure is logged, never fatal."""
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

    def _refusals(self) -> dict[str, Any]:
        """What every actor refused (from its latest heartbeat, and the controller's own counts), and the
        alarms a reader of summary.json must not miss."""
        reports = {self.actor_id: self.bus.refusal_stats()} | {
            actor: hb.stats for actor, hb in {**self.workers, **self.peers}.items()
        }
        by_category: dict[str, int] = {}
        for stats in reports.values():
            for key, value in stats.items():
                if key.startswith("refused_"):
                    by_category[key[len("refused_") :]] = by_category.get(key[len("refused_") :], 0) + int(value)
        alarms = []
        unsigned = {a: int(st.get("refused_unsigned", 0)) for a, st in reports.items() if st.get("refused_unsigned")}
        if unsigned:
            alarms.append(
                f"{sum(unsigned.values())} messages without a valid signature were refused (forged or altered): "
                + ", ".join(f"{a}: {n}" for a, n in sorted(unsigned.items()))
            )
        if self.audit.mismatches:
            alarms.append(f"{self.audit.mismatches} held-weight reports did not match the announced weights")
        return {
            "dead_lettered": sum(int(st.get("dead_lettered", 0)) for st in reports.values()),
            "refused": dict(sorted(by_category.items())),
            "alarms": alarms,
        }

    async def _finish(self, trainer_done: TrainerDone, done: asyncio.Event) -> None:
        """Evaluate the final version, write the summary, stop every actor."""
        eval_id = await self.evals.request(trainer_done.policy_version)
        final = await self.evals.wait(eval_id, self.cfg.eval.final_timeout_s)
        if final is None:
            self.log.error(
                "final_eval_timed_out", version=trainer_done.policy_version, after_s=self.cfg.eval.final_timeout_s
            )
        outstanding = self.state.issued - self.state.discarded - self.record.groups_trained
        summary = self.record.write_summary(
            status="complete",
            final_eval="done" if final is not None else f"timed out after {self.cfg.eval.final_timeout_s:g} s",
            steps=trainer_done.steps,
            final_version=trainer_done.policy_version,
            **self._refusals(),
            dlq_messages=await self.bus.dead_letter_stream_size(),
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
        await asyncio.to_thread(self.record.close)
        await self.bus.put_str(KEY_STATUS, "done")
        stop = Control(command="stop", reason="run complete", run_instance=self.run_instance)
        await self.bus.publish(self.bus.subjects.control, stop)
        self.log.info("run_complete", **{k: v for k, v in summary.items() if not isinstance(v, dict | list)})
        done.set()


async def pull_messages(bus: Bus, stream: str, durable: str, done: asyncio.Event) -> AsyncIterator[Msg]:
    """Every message of the durable pull consumer ``durable`` (made by the setup step) until ``done``; the
    caller acks. Binding, not creating: a restarted controller resumes where it stopped."""
    sub = await bus.js.pull_subscribe_bind(durable, stream=stream)
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
