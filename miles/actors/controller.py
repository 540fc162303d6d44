"""Controller: feeds prompt groups under the staleness bound, schedules evaluations, records the run.

Admission (AReaL-style credits): with the trainer at lineage step ``s`` (the step of its newest announced
version), ``B = groups_per_step`` and ``eta = max_staleness``, a group is issued only while
``issued - discarded < (eta + s + 1) * B``. A worker plays a group with a policy version >= the version it
was issued at, and the trainer consumes groups in batches of ``B``, so a trained group is at most ``eta``
steps old; the trainer re-checks on consumption because arrival order is not issue order. Versions are
unique ids (a trainer restart supersedes versions with new numbers), so the bound counts steps, which every
announcement carries, not version numbers.

State rebuilt from the bus. Everything the controller knows is a fold over two streams: EVENTS
(announcements, the trainer's discards, workers' held-weight reports, evaluation shard results) and METRICS
(step reports, its own evaluation results and issue records). Every ``bus.snapshot_every_steps`` steps it
writes that state with the stream position of each subject it folds (:mod:`miles.actors.snapshots`); at every
start it takes the newest snapshot and replays, in order, only what was stored after it
(:meth:`Controller._rebuild`), then goes on live. A batch of prompts is published only after its issue record
(:class:`~miles.bus.schema.GroupsIssued`) is stored, so a controller killed mid-batch finds the batch on
restart and publishes it again with the same contents: each prompt's message id is its group id, and the
prompt stream drops a copy it already holds. The run directory's files are cut back to what the snapshot had
written and the rest is rewritten by the same fold (:mod:`miles.actors.run_record`), so they are equal after any
number of controller restarts to those of an uninterrupted run.

It also audits weight sync (:mod:`miles.actors.weight_audit`) and owns held-out evaluation
(:mod:`miles.actors.evaluations`): the first version is evaluated before any prompt is issued, so
``eval_before`` is exactly the initial policy's, and the last one after the trainer is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.js.api import RawStreamMsg

from miles.actors import trust
from miles.actors.admission import AdmissionState, SampleOrder, admission_limit, issue_room, plan_batch
from miles.actors.base import Actor
from miles.actors.evaluations import EvalCoordinator
from miles.actors.retention import release_events_and_metrics
from miles.actors.run_record import RunRecord
from miles.actors.snapshots import EVENT_KEYS, FOLDED, FoldGate, newest_snapshot
from miles.actors.weight_audit import WeightAudit
from miles.algo.filters import over_issue_groups
from miles.bus.client import KEY_GROUPS_ISSUED, KEY_STATUS, messages_until
from miles.bus.errors import PayloadMissing
from miles.bus.follow import follow, next_message, stored_messages
from miles.bus.schema import (
    Control,
    ControllerSnapshot,
    EvalResult,
    EvalShardResult,
    GroupsDiscarded,
    GroupsIssued,
    Heartbeat,
    PromptGroup,
    SchemaError,
    StepMetrics,
    TrainerDone,
    WeightsAnnounced,
    WeightsHeld,
    decode_any,
    encode,
)
from miles.failpoints import failpoint
from miles.security.signing import SignatureError
from miles.sync.transport.dataplane import WeightStore
from miles.training.audit import AUDIT_KEYS, GAP_MAX_KEY, audit_alarm
from miles.training.lineage import VersionSteps, versions_kept

__all__ = ["AdmissionState", "Controller", "admission_limit"]

KEY_CONTROLLER_SEEN = "controller_seen"  # JSON {"events": seq, "metrics": seq}: how far the live readers got
VERSION_WAIT_S = 10.0  # how long (connected) a step report or trainer_done may overtake its announcement
ANNOUNCE_POLL_S = 0.5  # how often that wait looks at the connection
WORKER_TIMEOUT_S = 60.0  # a rollout worker unheard of for this long is no longer live

Handler = Callable[[RawStreamMsg, bool], Awaitable[None]]


class Abandoned(Exception):
    """A message left unhandled because the controller is stopping (its next start reads it again)."""


class _Anyone:
    """Every worker counts as live when a held-weight report is replayed (it was checked when it arrived)."""

    def __contains__(self, _: object) -> bool:
        return True


def stored_at(raw: RawStreamMsg) -> float | None:
    """When the server stored ``raw`` (unix seconds), None if the server did not say."""
    return raw.time.timestamp() if raw.time is not None else None


@dataclass
class AnnouncementReplay:
    """The stored announcements a rebuild reads as far as the reports it replays need them."""

    messages: AsyncIterator[RawStreamMsg]
    adopted: set[int] = field(default_factory=set)  # stream sequences of the announcements adopted
    read: int = 0
    done: bool = False


class Controller(Actor):
    role = "controller"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = AdmissionState()
        self.trainer_version = -1
        self.trainer_step = 0
        # announced version -> its lineage step, the newest versions_kept(eta) (the audit keeps as many)
        self.version_steps = VersionSteps(versions_kept(self.cfg.staleness.max_staleness))
        self._version_changed = asyncio.Condition()
        self._versions_idle = asyncio.Event()  # set while the announcement reader has read all there is
        self._eval_recorded = asyncio.Condition()  # notified when an EvalResult read from METRICS is recorded
        self.workers: dict[str, Heartbeat] = {}  # live rollout workers' latest heartbeats
        self.peers: dict[str, Heartbeat] = {}  # every other actor's latest heartbeat (their refusal counts)
        self._wake = asyncio.Event()
        self._admit_open = asyncio.Event()  # set once the initial evaluation is in (or on a resumed run)
        self.record = RunRecord(
            self.run_dir, run_name=self.cfg.name, wandb=self.cfg.monitor.wandb, config=self.cfg.model_dump(mode="json")
        )
        self.audit = WeightAudit(versions_kept(self.cfg.staleness.max_staleness), logger=self.log)
        # mode -> {versions, bytes, max} of the announced payloads (running totals: bounded for any run length)
        self.sync_bytes: dict[str, dict[str, int]] = {}
        self.last_batch: GroupsIssued | None = None  # the newest issue record (republished after a restart)
        self._replaying: AnnouncementReplay | None = None  # set while _rebuild replays the stored messages
        self._due_evals: list[int] = []  # versions whose evaluation was due while the controller was away
        self._trainer_done: TrainerDone | None = None  # seen in the replay: the end is still to be written
        self.restarts = 0  # earlier lives of this controller (issue records found at start)
        self.republished = {"prompts": 0, "deduplicated": 0}
        self._finishing = False
        self._seen: dict[str, int] = {}  # stream positions an earlier life had handled (state bucket)
        self._positions: dict[str, int] = {}  # ... and this life
        self.gate = FoldGate()  # a snapshot is cut only between two changes of the state
        self._folded = dict.fromkeys(FOLDED, 0)  # per FOLDED entry: the sequence of the last message folded in
        self.snapshots = {"written": 0, "failed": 0, "restored_from_step": -1}
        self._restored_positions: dict[str, int] | None = None  # of the snapshot this life started from

    @property
    def resolved(self) -> Any:
        return self.state.resolved

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
        self.order = SampleOrder(self.samples, cfg.seed)
        held_out = task.samples("eval")[: cfg.eval.max_samples]
        self.run_instance = await self.bus.claim_run_instance()
        self.evals = EvalCoordinator(
            self.bus,
            held_out,
            every=cfg.eval.every,
            shard_size=cfg.eval.shard_size,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens,
            last_step=cfg.trainer.steps,
            reward_range=cfg.task.reward_range,
            step_of=self.version_steps.get,
            # Claims are derived from the controller's signing key (on an open bus, where anyone may read and
            # publish anything, from the run instance: it still tells this run's shards from an earlier run's).
            claim_key=(self.bus.signer.key.seed if self.bus.signer is not None else self.run_instance).encode(),
        )
        await self._publish_run_info()
        # The data plane, read-only: an announced version is believed only if its payload is there.
        self.weights = await WeightStore.create(self.bus.js, self.bus.subjects.run, ensure=False)
        self.weights_delta = self.weights.sibling("delta")
        self._seen = json.loads(await self.bus.get_str(KEY_CONTROLLER_SEEN) or "{}")
        positions = await self._rebuild()
        self._positions = dict(positions)
        await self.bus.put_str(KEY_STATUS, "running")
        done = self._done_event = asyncio.Event()
        s = self.bus.subjects
        async with asyncio.TaskGroup() as tg:
            self._tasks = tg  # one-off tasks (the initial evaluation, the end of the run) are supervised here too
            tg.create_task(self._follow_versions(done), name="controller.versions")
            tg.create_task(self._follow_heartbeats(done), name="controller.heartbeats")
            live = (
                (s.metrics_stream, s.metrics_all, positions["metrics"], self._on_metrics),
                (s.events_stream, s.discarded, positions["events"], self._on_discard),
                (s.events_stream, s.weights_held, positions["events"], self._on_held),
                (s.events_stream, s.eval_results, positions["events"], self._on_eval_shard),
            )
            for stream, subject, after, handle in live:
                tg.create_task(self._follow(stream, subject, after, done, handle), name=f"controller.{subject}")
            tg.create_task(self._admit(done), name="controller.admission")
            tg.create_task(self._keep_positions(done), name="controller.positions")
            tg.create_task(self._keep_snapshots(done), name="controller.snapshots")
            self._resume(done)
            stop_waiter = tg.create_task(self.stopping.wait(), name="controller.stop")
            await asyncio.wait([stop_waiter, tg.create_task(done.wait())], return_when=asyncio.FIRST_COMPLETED)
            done.set()
            stop_waiter.cancel()
        await asyncio.to_thread(self.record.close)  # idempotent: also after a stop before the end

    async def _publish_run_info(self) -> None:
        """Write the run info once (kept as it is after a restart): what workers join by (docs/protocol.md)."""
        from miles.bus.runinfo import RunInfoError, build_run_info, publish_run_info
        from miles.models.loading import prepared_model_dir

        model_dir = prepared_model_dir(self.cfg.model, self.cfg.task)
        info, files = await asyncio.to_thread(build_run_info, self.cfg, model_dir, run_nonce=self.run_instance)
        info = await publish_run_info(self.bus.js, info, files)
        if info.run_nonce != self.run_instance:
            raise RunInfoError(
                f"bucket {self.cfg.name}_RUNINFO names run instance {info.run_nonce[:8]}..., the state bucket "
                f"{self.run_instance[:8]}...: an earlier run's leftovers; delete that run's streams"
            )
        self.log.info("run_info", run_instance=info.run_nonce[:8], task=info.task.type, files=len(info.files))

    # ------------------------------------------------------------------ rebuilding from the streams

    async def _rebuild(self) -> dict[str, int]:
        """Take the newest snapshot, then replay what EVENTS and METRICS stored after it (everything, without
        one): the admission state, the version registry, the audit, the evaluations and the record files.
        Returns the stream positions live reading goes on after."""
        js, s = self.bus.js, self.bus.subjects
        started = time.perf_counter()
        snapshot = await newest_snapshot(self.bus)
        if snapshot is not None:
            self._restore(snapshot)
        at = dict(self._folded)  # what the snapshot holds (zeros: nothing)
        self.record.begin_rebuild(snapshot.record.file_sizes if snapshot is not None else None)
        # 1. issue records, step reports, evaluation results, trainer_done, with the announcements each refers to
        # read as it needs them (the version map keeps only the newest versions: all of them first, and a long
        # replay without a snapshot would refuse its early reports as never announced)
        replayed = 0
        announcements = AnnouncementReplay(stored_messages(js, s.events_stream, s.weights, after_seq=at["weights"]))
        self._replaying = announcements
        try:
            metrics_seq = at["metrics"]
            async for raw in stored_messages(js, s.metrics_stream, s.metrics_all, after_seq=metrics_seq):
                replayed += 1
                metrics_seq = raw.seq or metrics_seq
                await self._on_metrics(raw, True)
            await self._replay_announcements(None)  # the announcements after the last report
        finally:
            self._replaying = None
        replayed += announcements.read
        # 2. in stream order: announcements (for the audit), discards, held weights, evaluation shards; each
        # subject from where the snapshot's fold of it ended
        events_seq = min(at[key] for key in EVENT_KEYS)
        async for raw in stored_messages(js, s.events_stream, f"{s.run}.events.>", after_seq=events_seq):
            events_seq = raw.seq or events_seq
            key = self._fold_key(raw.subject)
            if key is None or events_seq <= at[key]:
                continue
            replayed += 1
            if key == "weights":
                ann = decode_any(raw.data) if events_seq in announcements.adopted else None  # checked in step 1
                if isinstance(ann, WeightsAnnounced):
                    self._adopt_totals(ann)
            elif key == "discarded":
                await self._on_discard(raw, True)
            elif key == "weights_held":
                await self._on_held(raw, True)
            else:
                await self._on_eval_shard(raw, True)
        self.record.end_rebuild()
        events_seq = max(events_seq, *(at[key] for key in EVENT_KEYS))
        self._folded = {key: events_seq for key in FOLDED} | {"metrics": metrics_seq}
        if self.last_batch is not None:
            self.restarts = 1
            self.log.info(
                "controller_rebuilt",
                snapshot_step=self.snapshots["restored_from_step"],
                replayed=replayed,
                issued=self.state.issued,
                discarded=self.state.discarded,
                trained=self.record.totals.groups,
                steps=len(self.record.totals.steps),
                evals=len(self.record.evals),
                seconds=round(time.perf_counter() - started, 3),
            )
        return {"metrics": metrics_seq, "events": events_seq}

    async def _replay_announcements(self, version: int | None) -> None:
        """Rebuilding: adopt the stored announcements up to ``version`` (None: all of them), as a live controller
        had read them when the report that names ``version`` arrived. A no-op outside a rebuild."""
        replay = self._replaying
        if replay is None:
            return
        while not replay.done and (version is None or self.trainer_version < version):
            raw = await anext(replay.messages, None)
            if raw is None:
                replay.done = True
                return
            replay.read += 1
            ann = await self._accepted(raw, replaying=True)
            if not isinstance(ann, WeightsAnnounced) or ann.version <= self.trainer_version:
                continue
            if trust.announcement_refusal(
                ann, newest=self.trainer_version, max_steps=self.cfg.trainer.steps, stored=True
            ):
                continue  # refused when it arrived
            self._adopt_step(ann)
            replay.adopted.add(raw.seq)
            if not ann.replayed and ann.step > 0 and self.evals.due(ann.step, self.cfg.trainer.steps):
                self._due_evals.append(ann.version)

    def _fold_key(self, subject: str) -> str | None:
        """The :data:`FOLDED` entry a message on ``subject`` belongs to (None: one the controller does not fold)."""
        if subject.startswith(f"{self.bus.subjects.run}.metrics."):
            return "metrics"
        key = subject.rsplit(".", 1)[-1]
        return key if key in FOLDED else None

    # ------------------------------------------------------------------ snapshots

    def _snapshot(self) -> ControllerSnapshot:
        """The state as it is now (call it inside ``self.gate.quiet()``, without awaiting: it must not change)."""
        return ControllerSnapshot(
            positions=dict(self._folded),
            admission=self.state.part(),
            last_batch=self.last_batch,
            trainer_version=self.trainer_version,
            trainer_step=self.trainer_step,
            version_steps=sorted(self.version_steps.items()),
            sync_bytes={mode: dict(totals) for mode, totals in self.sync_bytes.items()},
            audit=self.audit.part(),
            evaluations=self.evals.parts(),
            due_evals=sorted(set(self.evals.open_versions()) | set(self._due_evals)),
            trainer_done=self._trainer_done,
            refused=dict(self.bus.refused),
            dead_lettered=self.bus.dead_lettered,
            record=self.record.part(),
        )

    def _restore(self, snapshot: ControllerSnapshot) -> None:
        """Take a snapshot's state (a fresh controller, before the replay of what was stored after it)."""
        self._folded = dict.fromkeys(FOLDED, 0) | dict(snapshot.positions)
        self.state = AdmissionState.from_part(snapshot.admission)
        self.last_batch = snapshot.last_batch
        self.trainer_version, self.trainer_step = snapshot.trainer_version, snapshot.trainer_step
        self.version_steps.restore(snapshot.version_steps)  # in place: the evaluations look steps up through it
        self.sync_bytes = {mode: dict(totals) for mode, totals in snapshot.sync_bytes.items()}
        self.audit.restore(snapshot.audit)
        self.evals.restore(snapshot.evaluations)
        self._due_evals = list(snapshot.due_evals)
        self._trainer_done = snapshot.trainer_done
        self.bus.refused.update(snapshot.refused)
        self.bus.dead_lettered += snapshot.dead_lettered
        self.record.restore(snapshot.record)
        self.snapshots["restored_from_step"] = len(self.record.totals.steps)
        self._restored_positions = dict(snapshot.positions)

    async def _keep_snapshots(self, done: asyncio.Event) -> None:
        """Write a snapshot each time the recorded steps pass a multiple of ``bus.snapshot_every_steps``, until the
        run is done."""
        every = self.cfg.bus.snapshot_every_steps
        cut_at = max(self.snapshots["restored_from_step"], 0)
        kept = self._restored_positions  # the older of the two snapshots a restart may take
        while not done.is_set():
            steps = len(self.record.totals.steps)
            if steps // every > cut_at // every:
                async with self.gate.quiet():
                    await self._advance_idle_positions()
                    snapshot = self._snapshot()
                cut_at = steps
                if not await self._write_snapshot(snapshot):
                    continue
                if kept is not None and self.cfg.bus.retention == "recovery":
                    first = await release_events_and_metrics(self.bus, kept)
                    self.log.info("streams_released", **{f"{stream}_first_kept": seq for stream, seq in first.items()})
                kept = dict(snapshot.positions)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=0.5)

    async def _advance_idle_positions(self) -> None:
        """Move the position of each EVENTS subject with nothing stored after it up to the stream's last sequence
        (call it inside ``self.gate.quiet()``). A subject that has no messages (no discards, say) would otherwise
        stay at 0 and the next restart would read EVENTS from its start; a message read but held at the gate is
        found by the leader read, so its subject keeps its position."""
        js, s = self.bus.js, self.bus.subjects
        last = (await js.stream_info(s.events_stream)).state.last_seq
        for key in EVENT_KEYS:
            if self._folded[key] < last:
                subject = f"{s.run}.events.{key}"
                if await next_message(js, s.events_stream, subject, self._folded[key], leader=True) is None:
                    self._folded[key] = last

    async def _write_snapshot(self, snapshot: ControllerSnapshot) -> bool:
        """Store ``snapshot``; False if it is too large for the server (the previous one stands: a restart replays
        more, loses nothing)."""
        size = len(encode(snapshot))
        if size > self.bus.nc.max_payload:
            self.snapshots["failed"] += 1
            self.log.error("snapshot_too_large", bytes=size, max_payload=self.bus.nc.max_payload)
            return False
        await self.bus.publish(self.bus.subjects.snapshot, snapshot)
        self.snapshots["written"] += 1
        self.log.info("snapshot_written", steps=len(self.record.totals.steps), positions=snapshot.positions)
        return True

    def _resume(self, done: asyncio.Event) -> None:
        """After the replay: open admission on a run that issued before, re-send the newest batch, ask for the
        evaluations that fell due meanwhile, and finish a run whose trainer is done."""
        if self.last_batch is not None:
            self._admit_open.set()  # the initial evaluation happened before the first issue
            self._tasks.create_task(self._republish(self.last_batch), name="controller.republish")
        elif self.trainer_version >= 0:  # announced, nothing issued yet: the initial evaluation comes first
            self._tasks.create_task(self._initial_eval(self.trainer_version, done), name="controller.initial_eval")
        for version in self._due_evals:
            if not self.evals.completed(version):
                self._tasks.create_task(self.evals.request(version), name=f"controller.eval_v{version}")
        if self._trainer_done is not None:
            self._tasks.create_task(self._finish(self._trainer_done, done), name="controller.finish")

    async def _republish(self, batch: GroupsIssued) -> None:
        """Publish the newest batch again (a restart may have cut it off): the stream keeps one copy of each."""
        await self._raise_window(batch.end_index)
        for ack in await self._publish_batch(batch):
            self.republished["prompts"] += 1
            self.republished["deduplicated"] += int(bool(ack.duplicate))
        self.log.info("batch_republished", first=batch.first_index, groups=len(batch.sample_ids), **self.republished)

    async def _follow(self, stream: str, subject: str, after: int, done: asyncio.Event, handle: Handler) -> None:
        key = "metrics" if stream == self.bus.subjects.metrics_stream else "events"
        folded = self._fold_key(subject) or key
        async for raw in follow(self.bus.nc, self.bus.js, stream, subject, done, after_seq=after, poll_s=0.5):
            try:
                async with self.gate.folding():  # the change and its position go into a snapshot together
                    await handle(raw, False)
                    self._folded[folded] = max(self._folded[folded], raw.seq or 0)
            except Abandoned as why:  # stopping: not handled, so not a position either (read again at a restart)
                self.log.info("message_left_for_restart", subject=raw.subject, seq=raw.seq, why=str(why))
                return
            self._positions[key] = max(self._positions.get(key, 0), raw.seq or 0)

    def _seen_before(self, raw: RawStreamMsg, replaying: bool) -> bool:
        """Whether an earlier life of this controller handled ``raw`` already (its positions in the state
        bucket): a refusal of it was dead-lettered then, and is only counted again now."""
        if not replaying:
            return False
        stream = "metrics" if raw.subject.startswith(f"{self.bus.subjects.run}.metrics.") else "events"
        return (raw.seq or 0) <= self._seen.get(stream, 0)

    async def _accepted(self, raw: RawStreamMsg, *, replaying: bool) -> Any:
        """The message in ``raw``, decoded and verified, or None if refused. The refusal of a message an earlier
        life refused already is counted again (the summary's refusal counts survive a restart), not
        dead-lettered twice."""
        if not self._seen_before(raw, replaying):
            return await self.bus.accept_any(raw)
        try:
            message = decode_any(raw.data)
            self.bus.check_signature(raw, message.KIND)
        except (SchemaError, SignatureError) as exc:
            self.bus.refused["malformed" if isinstance(exc, SchemaError) else "unsigned"] += 1
            self.bus.dead_lettered += 1
            return None
        return message

    async def _refuse(self, raw: RawStreamMsg, reason: str, *, replaying: bool) -> None:
        if self._seen_before(raw, replaying):
            self.bus.refused["untrusted"] += 1
            self.bus.dead_lettered += 1
        else:
            await self.bus.refuse(raw, reason, category="untrusted")

    async def _keep_positions(self, done: asyncio.Event) -> None:
        """Write how far the live readers got into the state bucket (every second while it moves, and at the end),
        so a restarted controller knows which refusals it has dead-lettered already."""
        written: dict[str, int] = {}
        while True:
            if self._positions != written:
                written = dict(self._positions)
                await self.bus.put_str(KEY_CONTROLLER_SEEN, json.dumps(written))
            if done.is_set():
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=1.0)

    # ------------------------------------------------------------------ admission

    async def _admit(self, done: asyncio.Event) -> None:
        trainer = self.cfg.trainer
        while not self._admit_open.is_set() and not done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._admit_open.wait(), timeout=0.5)
        while not done.is_set():
            self._wake.clear()  # before reading the step: a bump from here on wakes the wait below
            room = issue_room(
                self.state,
                step=self.trainer_step,
                max_staleness=self.cfg.staleness.max_staleness,
                groups_per_step=trainer.groups_per_step,
                steps=trainer.steps,
                over_issue=over_issue_groups(trainer.algo, trainer.groups_per_step),  # filtered groups' replacements
            )
            if room > 0 and self.trainer_version >= 0:
                # A snapshot holds a batch's state only with its issue record stored (both, or neither).
                async with self.gate.folding():
                    batch = plan_batch(self.state, self.order, room, self.trainer_version)
                    # The issue record goes first: a restart finds the batch and publishes it again, same contents.
                    await self.bus.publish(self.bus.subjects.issued, batch, msg_id=f"issued-{batch.first_index}")
                    self.last_batch = batch
                # Open the trainer's issue window before the prompts go out: their trajectories can be back
                # before this batch ends, and one past the window is refused as never issued.
                await self._raise_window(batch.end_index)
                await self._publish_batch(batch)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)

    async def _raise_window(self, issued: int) -> None:
        if await self.bus.get_int(KEY_GROUPS_ISSUED, 0) < issued:
            await self.bus.put_int(KEY_GROUPS_ISSUED, issued)

    async def _publish_batch(self, batch: GroupsIssued) -> list[Any]:
        """Publish a batch's prompt groups all at once (pipelined: a worker finds the whole batch in the stream
        and starts its groups together, in one engine batch, instead of one by one as the acks came back)."""

        async def publish(i: int, sample_id: str, attempt: int) -> Any:
            sample = self.samples[sample_id]
            group = PromptGroup(
                group_id=f"g{batch.first_index + i}",
                sample_id=sample.id,
                prompt=sample.prompt,
                answer=sample.answer,
                meta=sample.meta,
                group_size=self.cfg.rollout.group_size,
                issue_index=batch.first_index + i,
                issued_at_version=batch.issued_at_version,
                attempt=attempt,
            )
            # The group id as message id: a copy sent again (a restart) is stored once.
            ack = await self.bus.publish(self.bus.subjects.prompts, group, msg_id=group.group_id)
            failpoint("issue")  # part of a batch is stored (tests kill the controller mid-burst here)
            return ack

        async with asyncio.TaskGroup() as tg:  # a publish that fails cancels the others and fails the controller
            pending = [
                tg.create_task(publish(i, s, a))
                for i, (s, a) in enumerate(zip(batch.sample_ids, batch.attempts, strict=True))
            ]
        return [task.result() for task in pending]

    # ------------------------------------------------------------------ versions

    async def _follow_versions(self, done: asyncio.Event) -> None:
        """Take the trainer's version from its announcements, newest first, then every new one in order."""
        s = self.bus.subjects
        versions = follow(
            self.bus.nc, self.bus.js, s.events_stream, s.weights, done, start="last", idle=self._versions_idle
        )
        async for raw in versions:
            async with self.gate.folding():
                await self._on_announcement(raw, done)
                self._folded["weights"] = max(self._folded["weights"], raw.seq or 0)

    async def _on_announcement(self, raw: RawStreamMsg, done: asyncio.Event) -> None:
        ann = await self.bus.accept(raw, WeightsAnnounced)
        if ann is None or ann.version <= self.trainer_version:
            return  # refused, or a version seen already (a replayed older announcement changes nothing)
        refusal = trust.announcement_refusal(
            ann, newest=self.trainer_version, max_steps=self.cfg.trainer.steps, stored=await self._stored(ann)
        )
        if refusal is not None:
            await self.bus.refuse(raw, f"weights_announced: {refusal}", category="untrusted")
            return
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

    def _adopt_step(self, ann: WeightsAnnounced) -> None:
        self.version_steps.learn(ann.version, ann.step)
        self.trainer_version, self.trainer_step = ann.version, ann.step

    def _adopt_totals(self, ann: WeightsAnnounced) -> None:
        self.audit.announce(ann)
        totals = self.sync_bytes.setdefault(ann.mode, {"versions": 0, "bytes": 0, "max": 0})
        totals["versions"] += 1
        totals["bytes"] += ann.size
        totals["max"] = max(totals["max"], ann.size)

    async def _adopt(self, ann: WeightsAnnounced, done: asyncio.Event) -> None:
        self._adopt_totals(ann)
        first = self.trainer_version < 0
        self._adopt_step(ann)
        async with self._version_changed:
            self._version_changed.notify_all()
        self._wake.set()
        if first and not self._admit_open.is_set():
            self._tasks.create_task(self._initial_eval(ann.version, done), name="controller.initial_eval")
        elif not ann.replayed and self.evals.due(ann.step, self.cfg.trainer.steps) and ann.step > 0:
            await self.evals.request(ann.version)

    async def _announced(self, version: int) -> None:
        """Wait (bounded) for ``version``'s announcement: a step report can overtake it (two readers).

        The clock runs only while connected and while the announcement reader has read everything there is
        (``_versions_idle``): an outage, or a leader election that the reader's requests (or its data-plane
        check of an announcement it holds) retry through, holds the announcement back for as long as it
        lasts; the report would otherwise be refused as never announced (it was, once: a hub node lost while
        the reader checked version 8's manifest). So the wait is ``VERSION_WAIT_S`` of such time, at most
        that plus ``bus.outage_budget_s`` in all.

        A controller that is stopping does not wait: it raises :class:`Abandoned`, and the message is read again at
        its next start (refused here, it would have been refused for the bus going away with the launcher; waited
        for, it held a SIGTERMed controller for the whole outage budget).
        """
        deadline = time.monotonic() + VERSION_WAIT_S + self.cfg.bus.outage_budget_s
        waited_s = 0.0
        async with self._version_changed:
            while self.trainer_version < version and waited_s < VERSION_WAIT_S and time.monotonic() < deadline:
                if self.stopping.is_set():
                    raise Abandoned(f"stopping before version {version} was announced")
                counts = self.bus.nc.is_connected and self._versions_idle.is_set()
                started = time.monotonic()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        self._version_changed.wait_for(lambda: self.trainer_version >= version), ANNOUNCE_POLL_S
                    )
                if counts and self.bus.nc.is_connected and self._versions_idle.is_set():
                    waited_s += time.monotonic() - started

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

    # ------------------------------------------------------------------ inputs

    async def _follow_heartbeats(self, done: asyncio.Event) -> None:
        # one subscription per role: a remote fleet's heartbeats cross a leaf link only so (Subjects.heartbeats)
        subjects = self.bus.subjects.heartbeats(trust.ROLES)
        subs = [await self.bus.nc.subscribe(subject) for subject in subjects]
        async with asyncio.TaskGroup() as tg:
            for subject, sub in zip(subjects, subs, strict=True):
                tg.create_task(self._follow_heartbeat_subscription(sub, done), name=f"controller.{subject}")

    async def _follow_heartbeat_subscription(self, sub: Any, done: asyncio.Event) -> None:
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
        stored meanwhile arrive before the workers' next heartbeats do."""
        deadline = time.monotonic() + 3 * self.cfg.bus.heartbeat_s + 1.0
        while worker_id not in self.live_workers() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def live_workers(self) -> set[str]:
        now = time.time()
        return {w for w, hb in self.workers.items() if now - hb.ts < WORKER_TIMEOUT_S}

    async def _on_discard(self, raw: RawStreamMsg, replaying: bool) -> None:
        message = await self._accepted(raw, replaying=replaying)
        if message is None:
            return
        if not isinstance(message, GroupsDiscarded):
            await self._refuse(raw, f"{message.KIND}: not a groups_discarded on {raw.subject}", replaying=replaying)
            return
        refusal = trust.discard_refusal(message, issued=self.state.issued, resolved=self.resolved)
        if refusal is not None:
            await self._refuse(raw, f"groups_discarded: {refusal}", replaying=replaying)
            return
        self.state.fold_discard(message, raw.seq or 0, known=self.samples)
        t = stored_at(raw)
        for gid, sid in zip(message.group_ids, message.sample_ids, strict=True):
            self.record.ledger(
                "filtered" if message.reason == "filtered" else "requeued" if message.requeue else "dropped",
                t,
                group_id=gid,
                sample_id=sid,
                trainer_version=message.trainer_version,
                reason=message.reason,
            )
        self.record.count_discarded(len(message.group_ids), message.requeue, message.reason, message.model_tokens)
        self._wake.set()

    async def _on_metrics(self, raw: RawStreamMsg, replaying: bool) -> None:
        message = await self._accepted(raw, replaying=replaying)
        if message is None:
            return
        refusal: str | None = None
        if isinstance(message, StepMetrics):
            if replaying:
                await self._replay_announcements(message.policy_version)
            else:
                async with self.gate.outside():  # nothing changed yet: a snapshot may be cut while it waits
                    await self._announced(message.policy_version)
            refusal = trust.step_refusal(message, version_steps=self.version_steps, recorded=self.record.totals.steps)
            if refusal is None:
                lags = [
                    message.step - self.version_steps[hb.version]
                    for hb in self.workers.values()
                    if hb.version in self.version_steps
                ]
                for gid in message.trained_group_ids:
                    self.resolved.add(int(gid[1:]))
                self.record.step(message, stored_at(raw), worker_lag_mean=sum(lags) / len(lags) if lags else 0.0)
        elif isinstance(message, TrainerDone):
            if replaying:
                await self._replay_announcements(message.policy_version)
            else:
                async with self.gate.outside():
                    await self._announced(message.policy_version)
            refusal = trust.done_refusal(message, version_steps=self.version_steps, steps=self.cfg.trainer.steps)
            if refusal is None:
                self._trainer_done = message  # replaying: finished once the replay is over (_resume)
                if not replaying:
                    self._tasks.create_task(self._finish(message, self._done_event), name="controller.finish")
        elif isinstance(message, EvalResult):
            await self._replay_announcements(message.requested_version)  # rebuilding: the step it was requested at
            self.evals.mark_completed(message)
            self.record.eval(message, step=self.version_steps.get(message.requested_version, 0), t=stored_at(raw))
            async with self._eval_recorded:
                self._eval_recorded.notify_all()
        elif isinstance(message, GroupsIssued):
            refusal = self._issue_refusal(message, replaying)
            if refusal is None:
                self.record.issued(message, stored_at(raw))
                if replaying:
                    self.state.restore(message)
                    self.last_batch = message
        else:
            refusal = f"not a metrics message on {raw.subject}"
        if refusal is not None:
            await self._refuse(raw, f"{message.KIND}: {refusal}", replaying=replaying)

    def _issue_refusal(self, record: GroupsIssued, replaying: bool) -> str | None:
        """An issue record that does not continue the ones before it, or names a sample the task lacks."""
        if record.first_index != self.record.groups_issued:
            return f"issue record from g{record.first_index}, the record has {self.record.groups_issued} groups"
        unknown = [sid for sid in record.sample_ids if sid not in self.samples]
        if unknown:
            return f"sample {unknown[0]!r} is not in the task"
        if not replaying and record.end_index > self.state.issued:
            return f"issue record up to g{record.end_index - 1}, this controller issued {self.state.issued}"
        return None

    async def _on_eval_shard(self, raw: RawStreamMsg, replaying: bool) -> None:
        message = await self._accepted(raw, replaying=replaying)
        if message is None:
            return
        if not isinstance(message, EvalShardResult):
            await self._refuse(raw, f"{message.KIND}: not an eval_shard_result on {raw.subject}", replaying=replaying)
            return
        refusal = self.evals.refusal(message)
        if refusal is not None:
            await self._refuse(raw, f"eval_shard_result: {refusal}", replaying=replaying)
            if not replaying:
                await self.evals.reissue(message)
            return
        await self.evals.on_result(message)  # the last shard publishes the EvalResult, recorded from METRICS

    async def _on_held(self, raw: RawStreamMsg, replaying: bool) -> None:
        """Feed a worker's ``weights_held`` report to the audit."""
        message = await self._accepted(raw, replaying=replaying)
        if message is None:
            return
        if not isinstance(message, WeightsHeld):
            await self._refuse(raw, f"{message.KIND}: not a weights_held on {raw.subject}", replaying=replaying)
            return
        if not replaying:
            async with self.gate.outside():
                await self._heard_from(message.worker_id)
        workers = _Anyone() if replaying else self.live_workers()
        refusal = trust.held_refusal(message, workers=workers, newest=self.trainer_version)
        if refusal is not None:
            await self._refuse(raw, f"weights_held: {refusal}", replaying=replaying)
            return
        self.audit.report(message)

    # ------------------------------------------------------------------ the end

    async def _read_back(self, result: EvalResult) -> None:
        """Wait (bounded) until the record holds ``result`` as read back from METRICS: the summary is written from
        the record. The evaluation is complete (and :meth:`_finish` woken) as soon as the server acks the
        EvalResult, before the METRICS reader has read it; in a cluster the reader's direct get can even be
        answered by a replica that has not stored it yet, and the reader then looks again only a poll period
        later. Without this wait summary.json could name the previous evaluation as eval_after."""
        step = self.version_steps.get(result.requested_version, 0)
        if step in self.record.evals:
            return
        started = time.perf_counter()
        async with self._eval_recorded:
            try:
                await asyncio.wait_for(self._eval_recorded.wait_for(lambda: step in self.record.evals), VERSION_WAIT_S)
            except asyncio.TimeoutError:
                # Stored (the publish was acked) but not read back: record it from here, as the reader would.
                self.log.warning("final_eval_not_read_back", version=result.requested_version, after_s=VERSION_WAIT_S)
                self.record.eval(result, step=step)
                return
        waited = round(time.perf_counter() - started, 3)
        self.log.info("final_eval_read_back", version=result.requested_version, waited_s=waited)

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
        if alarm := audit_alarm({key: self._trainer_count(key) for key in AUDIT_KEYS}):
            alarms.append(alarm)
        return {
            "dead_lettered": sum(int(st.get("dead_lettered", 0)) for st in reports.values()),
            "refused": dict(sorted(by_category.items())),
            "alarms": alarms,
        }

    def _trainers(self) -> list[Heartbeat]:
        """The trainer actors' latest heartbeats."""
        return [hb for hb in self.peers.values() if hb.role == "trainer"]

    def _trainer_count(self, key: str) -> int:
        """A count from the trainer's latest heartbeat (summed over trainer actors; 0 when it never reported it)."""
        return sum(int(hb.stats.get(key, 0)) for hb in self._trainers())

    async def _finish(self, trainer_done: TrainerDone, done: asyncio.Event) -> None:
        """Evaluate the final version, write the summary, stop every actor."""
        if self._finishing:
            return  # a second trainer_done (a trainer restarted after its last step)
        self._finishing = True
        eval_id = await self.evals.request(trainer_done.policy_version)
        final = await self.evals.wait(eval_id, self.cfg.eval.final_timeout_s)
        if final is None:
            self.log.error(
                "final_eval_timed_out", version=trainer_done.policy_version, after_s=self.cfg.eval.final_timeout_s
            )
        else:
            await self._read_back(final)
        outstanding = self.state.issued - self.state.discarded - self.record.totals.groups
        summary = self.record.write_summary(
            status="complete",
            final_eval="done" if final is not None else f"timed out after {self.cfg.eval.final_timeout_s:g} s",
            steps=trainer_done.steps,
            final_version=trainer_done.policy_version,
            **self._refusals(),
            dlq_messages=await self.bus.dead_letter_stream_size(),
            groups_issued=self.state.issued,
            groups_outstanding=outstanding,
            # a prompt sent again after a controller restart: stored once (deduplicated), or played again and
            # skipped by the trainer as a duplicate (the trainer's count, from its heartbeat)
            prompts_republished=self.republished["prompts"],
            prompts_deduplicated=self.republished["deduplicated"],
            trajectories_duplicate=self._trainer_count("duplicates"),
            # of which a second trajectory of a group (generated twice: a redelivered prompt another worker played)
            groups_generated_again=self._trainer_count("generated_again"),
            # the trainer's trajectory audit (trainer.audit: rewards and log-probs; zeros when off)
            audit={key.removeprefix("audit_"): self._trainer_count(key) for key in AUDIT_KEYS}
            | {"logprob_gap_max": max((hb.stats.get(GAP_MAX_KEY, 0.0) for hb in self._trainers()), default=0.0)},
            # prompts a restarted server redelivered to the worker that had them, recognised there (not played again)
            prompts_redelivered_skipped=sum(
                int(hb.stats.get("redeliveries_skipped", 0)) for hb in self.workers.values()
            ),
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
