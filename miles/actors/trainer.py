"""Trainer leader (rank 0): pulls trajectories, trains, publishes versions, checkpoints at an interval.

Per step: collect ``groups_per_step`` fresh, untrained trajectories from the durable TRAJ consumer; train
(all ranks, :class:`~miles.training.rank_worker.RankWorker`); export and publish the new version, whose
announcement names the TRAJ stream sequences of the batch (``consumed``); publish the step's metrics; ack
the trajectories; every ``trainer.checkpoint_every`` steps write a sharded checkpoint that records the
EVENTS position of its version's announcement.

Exactly-once without unbounded memory (docs/architecture.md, "Delivery and restart contract"): acks do not
wait for a checkpoint, because the announcements are the durable record of which batch made which
version. After a crash the trainer restores the newest checkpoint and replays, on the restored weights,
the batches of the versions published after it (:mod:`miles.training.recovery`), under new version
numbers. Trained and discarded groups are remembered as a compact set of issue indexes
(:class:`~miles.training.lineage.IndexSet`), staleness is measured along the version lineage
(:class:`~miles.training.lineage.VersionLineage`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from miles.actors import trust
from miles.actors.base import Actor, keep_in_progress
from miles.actors.retention import TrainerRetention, traj_ack_floor
from miles.actors.trainer_intake import Examined, TrajectoryIntake, on_thread_if
from miles.actors.trainer_ranks import LeaderRanks
from miles.algo.advantages import ADVANTAGES
from miles.algo.config import generation_budget
from miles.algo.filters import build_group_filter
from miles.algo.shaping import RewardShaper
from miles.backends.base import TrainSample
from miles.bus.client import KEY_GROUPS_ISSUED, Refusal
from miles.bus.errors import BusError
from miles.bus.schema import (
    GroupsDiscarded,
    Heartbeat,
    PromptGroup,
    SchemaError,
    StepMetrics,
    TrainerDone,
    Trajectory,
    decode,
)
from miles.failpoints import failpoint
from miles.security.signing import SIGNATURE_HEADER, SIGNER_HEADER, SignatureError
from miles.sync.publisher import Lineage
from miles.sync.sender import WeightSender, build_sender
from miles.training.audit import DEFAULT_LOGPROB_TOLERANCE, RewardCheck, TrajectoryAudit, logprob_samples
from miles.training.batch import build_batch, group_rewards
from miles.training.intake import RecentSet, classify, judged_version
from miles.training.lineage import IndexSet, VersionLineage, versions_kept
from miles.training.recovery import fetch_batch, plan_recovery, read_history
from miles.training.step import plan_batch
from miles.training.teacher_client import teacher_client

OFF_LOOP_TOKENS = 100_000  # a batch this large takes ~10 ms to build and plan: done on a thread


class TrainerLeader(Actor):
    role = "trainer"

    weights: WeightSender  # stores, transport and publish path of cfg.sync (miles.sync.sender)

    def __init__(self, *args: Any, ranks: LeaderRanks, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ranks = ranks
        eta = self.cfg.staleness.max_staleness
        self.lineage = VersionLineage(keep_steps=versions_kept(eta))
        self.resolved = IndexSet()  # issue indexes of groups trained or discarded
        self.next_version = 1
        self.events_seq = 0  # EVENTS position of the newest announcement (a checkpoint records it)
        self.advantages = ADVANTAGES.build(self.cfg.trainer.algo.advantage)
        self.shaper = RewardShaper(self.cfg.trainer.algo, generation_budget(self.cfg))
        self.group_filter = build_group_filter(self.cfg.trainer.algo.filter)  # DAPO's dynamic sampling, or None
        self.teacher = teacher_client(self.cfg, self.bus)  # a bus teacher, or None
        self.counts = {
            "dropped": 0,
            "requeued": 0,
            "duplicates": 0,
            "generated_again": 0,
            "no_signal": 0,
            "filtered": 0,
            "replayed_steps": 0,
        }
        # Failed episodes of groups discarded since the last step (and groups filtered): reported with the next
        # step, so every resolved trajectory's failures are counted once, trained or not.
        self._discarded_failures = {"reward_failed": 0.0, "infra_excluded": 0.0, "groups_filtered": 0.0}
        self._last_checkpoint_step = 0
        # bus.retention recovery: trajectories no kept checkpoint needs are purged once a checkpoint completes
        self.retention = (
            TrainerRetention(self.bus, lambda: self.ranks.run(self.ranks.worker.checkpoints.oldest_extra))
            if self.cfg.bus.retention == "recovery"
            else None
        )
        self.audit: TrajectoryAudit | None = None  # trainer.audit: built at start (it loads the task and tokenizer)
        self._seen_seqs = RecentSet(keep=1 << 16)  # TRAJ sequences handled since this trainer started
        # Versions whose weights the ranks keep for the log-prob audit (as many as miles.training.snapshots keeps).
        self._snapshotted: deque[int] = deque(maxlen=eta + 1)

    def heartbeat(self) -> Heartbeat:
        stats = {
            "step": float(self.lineage.step),
            "trained_groups": float(len(self.resolved)),
            **self.bus.refusal_stats(),
            **{k: float(v) for k, v in self.counts.items()},
            **(self.audit.stats() if self.audit is not None else {}),
        }
        return Heartbeat(role=self.role, actor_id=self.actor_id, version=self.lineage.version, stats=stats)

    # ------------------------------------------------------------------ start-up and recovery

    async def main(self) -> None:
        from miles.models.loading import prepared_model_dir, vocab_size

        cfg = self.cfg
        self.vocab_size = vocab_size(prepared_model_dir(cfg.model, cfg.task))
        audit = cfg.trainer.audit
        self.audit = await asyncio.to_thread(self._build_audit) if audit.rate or audit.logprob_rate else None
        self._issued = 0  # the controller's issue window (state bucket), read again when a group lies past it
        self.weights = await build_sender(cfg, self.bus, self.ranks, self.run_dir, self.log)
        await self._recover()
        sub = await self.bus.js.pull_subscribe_bind(
            durable=self.bus.subjects.TRAINER_CONSUMER, stream=self.bus.subjects.traj_stream
        )
        want = cfg.trainer.groups_per_step
        intake = TrajectoryIntake(sub, self._examine, ahead=want, ping_s=cfg.bus.ack_wait_s / 3)
        last_step_end = time.perf_counter()
        try:
            # The next batch is pulled and examined while one trains; what it pulled ahead is nak'ed at the end.
            async with intake:
                while self.lineage.step < cfg.trainer.steps and not self.stopping.is_set():
                    failpoint("between_steps")
                    intake.resume()
                    collected = await self._collect(intake)
                    if collected is None:
                        break  # stopping: the held trajectories were nak'ed for redelivery
                    intake.pause()  # until the ranks train: building the batch comes first
                    msgs, trajs = collected
                    seqs = [m.metadata.sequence.stream for m in msgs]
                    await self._step(trajs, seqs, msgs, replayed=False, started=last_step_end, training=intake.resume)
                    last_step_end = time.perf_counter()
        finally:
            await sub.unsubscribe()
        if self.lineage.step > self._last_checkpoint_step:  # done, or draining: nothing trained is redone
            await self.ranks.call("save_checkpoint", self.lineage.step, await self._checkpoint_extra())
        await self.ranks.call("close")
        if not self.stopping.is_set():  # a draining trainer's bus may be gone: its next start releases
            await self._release()
        if self.lineage.step >= cfg.trainer.steps:
            await self.beat()  # the final counts first: the controller writes the summary from them
            done = TrainerDone(policy_version=self.lineage.version, steps=self.lineage.step)
            await self.bus.publish(self.bus.subjects.done, done)
            self.log.info("trainer_done", version=self.lineage.version, steps=self.lineage.step)
        await self.ranks.stop()

    async def _recover(self) -> None:
        """Restore the newest checkpoint, supersede what was published after it, replay its lost steps."""
        extra = await self.ranks.call("restore")
        if extra is None:  # a fresh start: the initial weights are version 0, step 0
            checkpoint_version, checkpoint_step = 0, 0
        else:
            checkpoint_version, checkpoint_step = int(extra["version"]), int(extra["step"])
            self.lineage = VersionLineage.from_json(extra["lineage"], self.lineage.keep_steps)
            self.resolved = IndexSet.from_json(extra["resolved"])
            self.events_seq = int(extra["events_seq"])
            if self.audit is not None:
                self.audit.excluded.update(extra.get("audit_excluded", []))
            self._last_checkpoint_step = checkpoint_step
            self.log.info("trainer_resumed", step=checkpoint_step, version=checkpoint_version)
        history = await read_history(self.bus, self.events_seq)
        plan = plan_recovery(checkpoint_version, checkpoint_step, history)
        await self.weights.connect(first_start=extra is None and history.max_version < 0)
        for index in history.discarded:
            self.resolved.add(index)
        self.lineage.supersede(plan.lost, fork_step=checkpoint_step)
        newest = max([history.max_version, checkpoint_version, *await self.weights.stored_versions()])
        nothing_published = extra is None and history.max_version < 0
        if extra is None and not nothing_published:
            self.lineage.alive[0] = 0  # the initial weights, rebuilt from the same model: version 0 stands
        self.next_version = 0 if nothing_published else newest + 1
        if nothing_published or plan.lost:
            # Workers may hold a lost version: give them the restored weights under a new number at once.
            await self._publish(step=checkpoint_step, consumed=[], replayed=bool(plan.lost))
        if plan.lost:
            self.log.warning(
                "trainer_recovering",
                checkpoint_step=checkpoint_step,
                lost_versions=sorted(plan.lost),
                replay_steps=[ann.step for ann in plan.replay],
            )
        for ann in plan.replay:
            trajs = await fetch_batch(self.bus, list(ann.consumed))
            await self._step(trajs, list(ann.consumed), [], replayed=True, started=time.perf_counter())
            self.counts["replayed_steps"] += 1

    # ------------------------------------------------------------------ collecting

    async def _collect(self, intake: TrajectoryIntake) -> tuple[list[Msg], list[Trajectory]] | None:
        """Take examined trajectories from the intake until a full batch of fresh, untrained ones is held
        (unacked)."""
        want = self.cfg.trainer.groups_per_step
        msgs: list[Msg] = []
        trajs: list[Trajectory] = []
        held: set[int] = set()
        to_check: list[Trajectory] = []  # drawn for the log-prob audit, not checked yet
        async with keep_in_progress(msgs, period_s=self.cfg.bus.ack_wait_s / 3):
            while len(trajs) < want or to_check:
                if to_check and len(trajs) >= want:  # the batch is full: check the drawn ones, refill if refused
                    by_group = dict(zip((t.group_id for t in trajs), msgs, strict=True))
                    refused = {t.issue_index for t in await self._audit_logprobs(to_check, by_group)}
                    kept = [i for i, t in enumerate(trajs) if t.issue_index not in refused]
                    msgs[:] = [msgs[i] for i in kept]  # in place: keep_in_progress pings this list
                    trajs = [trajs[i] for i in kept]
                    held -= refused
                    to_check = []
                    continue
                if self.stopping.is_set():
                    for m in msgs:
                        await m.nak()
                    return None
                # Exactly what the batch lacks: the controller issues steps x want in all (a surplus would
                # starve the last step).
                for examined in await intake.take(want - len(trajs), timeout_s=0.5):
                    m = examined.msg
                    traj = await self._accept(examined)
                    if traj is None:
                        continue
                    index = traj.issue_index
                    gf, shaper = self.group_filter, self.shaper
                    verdict = classify(
                        index,
                        resolved=self.resolved,
                        held=held,
                        lag=self.lineage.distance(
                            judged_version(traj.oldest_version, traj.newest_version, self.cfg.staleness.stale_prefix)
                        ),
                        max_staleness=self.cfg.staleness.max_staleness,
                        has_trained_episodes=bool(traj.trained_episodes),
                        keep=None if gf is None else (lambda t=traj: gf(group_rewards(t, shaper))),
                    )
                    seq = m.metadata.sequence.stream
                    if verdict == "duplicate":
                        self.counts["duplicates"] += 1
                        # A trajectory this trainer has not had before is another one of the group (it was played
                        # twice: miles/actors/deliveries.py); one it has had is delivered again (its ack was lost).
                        self.counts["generated_again"] += seq not in self._seen_seqs
                        self._seen_seqs.add(seq)
                        await m.ack()
                        continue
                    self._seen_seqs.add(seq)
                    if verdict == "stale":
                        await self._discard(m, traj, "stale", requeue=self.cfg.staleness.on_stale == "requeue")
                        continue
                    if verdict == "no_signal":
                        infra = any(e.status == "infra_error" for e in traj.episodes)
                        await self._discard(m, traj, "no_signal", requeue=infra)
                        continue
                    if verdict == "filtered":
                        await self._discard(m, traj, "filtered", requeue=False)  # its credit buys a new prompt
                        continue
                    held.add(index)
                    msgs.append(m)
                    trajs.append(traj)
                    if self.audit is not None and self.audit.draw_logprobs():
                        to_check.append(traj)
        return msgs, trajs

    async def _audit_logprobs(self, trajs: list[Trajectory], msgs: dict[str, Msg]) -> list[Trajectory]:
        """The log-prob audit of held trajectories (:mod:`miles.training.audit`): a no-grad forward of their
        episodes under the weights that sampled them (kept since they were published); those whose behaviour
        log-probs disagree are refused and issued again. Returns the refused."""
        assert self.audit is not None
        indexed: list[tuple[int, TrainSample]] = []
        owner: list[int] = []  # the trajectory of each sample
        for t, traj in enumerate(trajs):
            for sample in logprob_samples(traj, self._snapshotted):
                indexed.append((len(indexed), sample))
                owner.append(t)
        if not indexed:
            return []
        dp_size = self.ranks.worker.backend.dp_size
        sums = await self.ranks.call("logprob_gaps", [indexed[r::dp_size] for r in range(dp_size)], len(indexed))
        diff, tokens = [0.0] * len(trajs), [0.0] * len(trajs)
        for i, t in enumerate(owner):
            diff[t] += sums[2 * i]
            tokens[t] += sums[2 * i + 1]
        refused = []
        for t in sorted(set(owner)):
            traj = trajs[t]
            why = self.audit.judge_logprobs(traj, diff[t], tokens[t])
            if why is None:
                continue
            await self.bus.refuse(msgs[traj.group_id], f"trajectory: {why}", category="untrusted")
            await self._discard(None, traj, "invalid", requeue=True)
            refused.append(traj)
        return refused

    def _examine(self, m: Msg) -> Examined:
        """What a trajectory is, whatever the run's state: decoded, signed, its ticket verified, its content
        checked (on the intake's thread: no event loop, no side effects)."""
        verdict = self.bus.examine(m, Trajectory)
        if isinstance(verdict, Refusal):
            return Examined(m, None, None, verdict)
        try:
            ticket = self._ticket(verdict)
        except (SignatureError, SchemaError) as exc:
            return Examined(m, verdict, None, Refusal(f"trajectory {verdict.group_id}: ticket: {exc}", "untrusted"))
        why = trust.content_refusal(
            verdict, ticket, vocab_size=self.vocab_size, reward_range=self.cfg.task.reward_range
        )
        return Examined(m, verdict, ticket, None if why is None else Refusal(f"trajectory: {why}", "untrusted"))

    async def _accept(self, examined: Examined) -> Trajectory | None:
        """A delivered trajectory if it can be trained on; None once it was refused (and, for a group the
        controller did issue, discarded for re-issue so its admission credit comes back)."""
        m, traj, ticket, refusal = examined.msg, examined.trajectory, examined.ticket, examined.refusal
        if refusal is not None and (traj is None or ticket is None):
            # Undecodable, unsigned, a bad ticket, or refused with none: no issued group to give back.
            await self.bus.refuse(m, refusal.reason, category=refusal.category)
            return None
        assert traj is not None
        if traj.issue_index >= self._issued:  # the window grows as the controller issues: look again
            self._issued = await self.bus.get_int(KEY_GROUPS_ISSUED, 0)
        if refusal is None:
            why = trust.standing_refusal(traj, issued=self._issued, newest=self.next_version - 1)
            if why is None and self.audit is not None:
                why = await self.audit.refusal(traj, ticket)
            if why is None:
                return traj
            refusal = Refusal(f"trajectory: {why}", "untrusted")
        await self.bus.refuse(m, refusal.reason, category=refusal.category)
        if traj.issue_index < self._issued and ticket is not None and traj.issue_index not in self.resolved:
            await self._discard(None, traj, "invalid", requeue=True)
        return None

    def _build_audit(self) -> TrajectoryAudit:
        """The audit of cfg.trainer.audit; with rewards re-scored, over the task's own reward and the run's
        tokenizer (blocking: loads both)."""
        cfg = self.cfg
        audit = cfg.trainer.audit
        rewards = self._reward_check() if audit.rate > 0 else None
        return TrajectoryAudit(
            rewards,
            rate=audit.rate,
            tolerance=audit.tolerance,
            logprob_rate=audit.logprob_rate,
            logprob_tolerance=audit.logprob_tolerance or DEFAULT_LOGPROB_TOLERANCE,
            exclude_after=audit.exclude_after,
        )

    def _reward_check(self) -> RewardCheck:
        from miles.models.loading import load_tokenizer, prepared_model_dir
        from miles.tasks.base import TextTask
        from miles.tasks.registry import build_task

        cfg = self.cfg
        task = build_task(cfg.task, sandbox=cfg.rollout.sandbox)
        if not isinstance(task, TextTask):
            raise ValueError(
                f"trainer.audit.rate: task.type {cfg.task.type!r} has no reward(completion, sample) to re-score"
            )
        tokenizer = load_tokenizer(prepared_model_dir(cfg.model, cfg.task))
        # decoded as Renderer.decode on the worker
        return RewardCheck(task, lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))

    def _ticket(self, traj: Trajectory) -> PromptGroup | None:
        """The prompt group ``traj`` answers, as issued: required and verified when the run signs."""
        if self.bus.require_signatures and self.bus.verifier is not None:
            headers = {SIGNER_HEADER: "controller", SIGNATURE_HEADER: traj.ticket_signature}
            self.bus.verifier.verify(self.bus.subjects.prompts, traj.ticket, headers, "controller")
        return decode(traj.ticket, PromptGroup) if traj.ticket else None

    async def _discard(self, msg: Msg | None, traj: Trajectory, reason: str, *, requeue: bool) -> None:
        event = GroupsDiscarded(
            group_ids=[traj.group_id],
            sample_ids=[traj.sample_id],
            requeue=requeue,
            trainer_version=self.lineage.version,
            reason=reason,  # type: ignore[arg-type]
            model_tokens=traj.num_model_tokens,
        )
        ack = await self.bus.publish(self.bus.subjects.discarded, event)  # recorded durably before the ack
        self._discarded_failures["reward_failed"] += sum(e.status == "reward_failed" for e in traj.episodes)
        self._discarded_failures["infra_excluded"] += sum(e.status == "infra_error" for e in traj.episodes)
        self.events_seq = max(self.events_seq, int(ack.seq))
        self.resolved.add(traj.issue_index)
        if msg is not None:
            await msg.ack()
        self.counts["requeued" if requeue else "dropped"] += 1
        if reason in ("no_signal", "filtered"):
            self.counts[reason] += 1
        if reason == "filtered":
            self._discarded_failures["groups_filtered"] += 1
        self.log.info(
            "trajectory_discarded",
            group=traj.group_id,
            reason=reason,
            version=traj.oldest_version,
            trainer_version=self.lineage.version,
            requeue=requeue,
        )

    # ------------------------------------------------------------------ training

    def _fresh(self, version: int) -> bool:
        """Within the staleness bound now (``stale_prefix: mask`` trains only such tokens)."""
        lag = self.lineage.distance(version)
        return lag is not None and lag <= self.cfg.staleness.max_staleness

    @staticmethod
    def _oldest_trained(traj: Trajectory, fresh: Callable[[int], bool] | None) -> int:
        """The oldest version behind a token the step trains: with masking, the oldest fresh one."""
        if fresh is None:
            return traj.oldest_version
        kept = [v for e in traj.trained_episodes for _, v in e.spans if fresh(v)]
        return min(kept, default=traj.oldest_version)

    async def _step(
        self,
        trajs: list[Trajectory],
        seqs: list[int],
        msgs: list[Msg],
        *,
        replayed: bool,
        started: float,
        training: Callable[[], None] | None = None,
    ) -> None:
        """Train one batch, publish its version, ack it, checkpoint if due; ``training`` is called as the ranks
        start the update."""
        fresh = self._fresh if self.cfg.staleness.stale_prefix == "mask" else None
        # Per-token work: a large batch's on a thread, so the event loop keeps serving the intake, pings and
        # heartbeats; a small one's inline (see on_thread_if).
        large = sum(t.num_tokens for t in trajs) >= OFF_LOOP_TOKENS
        batch = await on_thread_if(large, build_batch, trajs, self.advantages, self.shaper, fresh)
        if self.teacher is not None:  # on-policy distillation from teacher actors: their log-probs of our tokens
            await self.teacher.fill(batch.samples, self.cfg.rollout.sampling.temperature or 1.0)
        lags = [self.lineage.distance(self._oldest_trained(t, fresh)) for t in trajs]
        staleness = [lag if lag is not None else -1 for lag in lags]
        dp_size = self.ranks.worker.backend.dp_size
        plan = await on_thread_if(large, plan_batch, batch.samples, self.cfg.trainer.algo.minibatches, dp_size)
        if training is not None:
            training()
        metrics = await self.ranks.call("train", plan)
        failpoint("train")  # weights updated in memory, nothing published yet
        step = self.lineage.step + 1
        version = await self._publish(step=step, consumed=seqs, replayed=replayed)
        failpoint("announced")  # published, its trajectories not acked yet
        step_s = time.perf_counter() - started
        metrics |= batch.metrics | {
            "step_s": step_s,
            "tokens_per_s": batch.metrics["tokens"] / step_s if step_s else 0.0,
        }
        for key, discarded in self._discarded_failures.items():
            metrics[key] = metrics.get(key, 0.0) + discarded
        report = StepMetrics(
            step=step - 1,
            policy_version=version,
            metrics=metrics,
            trained_group_ids=[t.group_id for t in trajs],
            staleness=[max(0, s) for s in staleness],
            replayed=replayed,
        )
        # The message id makes a re-sent report (a replayed step) a no-op in the stream.
        await self.bus.publish(self.bus.subjects.step, report, msg_id=f"step-v{version}")
        self._discarded_failures = dict.fromkeys(self._discarded_failures, 0.0)
        # All at once: an ack the server leaves unanswered (one of a delivery from before a server restart) costs
        # its retry budget, which in turn would stall the step once per trajectory. Unconfirmed: redelivered
        # later, and skipped as trained.
        await asyncio.gather(*(self.bus.ack(m) for m in msgs))
        for t in trajs:
            self.resolved.add(t.issue_index)
        if await self.ranks.run(self.ranks.worker.poll_checkpoint) is not None:
            await self._release()
        if self.ranks.worker.checkpoints.due(step):
            await self.ranks.call("save_checkpoint", step, await self._checkpoint_extra())
            self._last_checkpoint_step = step
            await self._release()  # a synchronous save is complete now (an asynchronous one: a no-op)
        self.log.info(
            "step",
            step=step - 1,
            version=version,
            reward=round(metrics["reward_mean"], 3),
            staleness_max=max(staleness, default=0),
            replayed=replayed,
        )

    async def _publish(self, *, step: int, consumed: list[int], replayed: bool) -> int:
        """Export the current weights and publish them as the next version (:mod:`miles.sync.sender`)."""
        version = self.next_version
        published = await self.weights.publish(version, Lineage(step, consumed, replayed))
        if self.audit is not None and self.audit.logprob_rate > 0:
            await self.ranks.call("snapshot_version", version)
            self._snapshotted.append(version)
        self.next_version = version + 1
        self.events_seq = max(self.events_seq, published.seq)
        self.lineage.advance(version, step)
        return version

    async def _release(self) -> None:
        if self.retention is not None:
            await self.retention.release()

    async def _traj_floor(self) -> dict[str, int]:
        """The checkpoint's ``traj_floor``: every trajectory at or below it is trained into this step (or before)
        or discarded, so a restart from here reads none of them (miles.actors.retention). Empty if the bus cannot
        say (a trainer draining after its bus went away): that checkpoint is still whole, it only releases nothing."""
        try:
            return {"traj_floor": await traj_ack_floor(self.bus)}
        except BusError as exc:
            self.log.warning("checkpoint_without_traj_floor", error=str(exc))
            return {}

    async def _checkpoint_extra(self) -> dict[str, Any]:
        return {
            "step": self.lineage.step,
            "version": self.lineage.version,
            "events_seq": self.events_seq,
            **await self._traj_floor(),
            "resolved": self.resolved.to_json(),
            "lineage": self.lineage.to_json(),
            # workers the reward audit stopped believing stay excluded after a restart
            "audit_excluded": sorted(self.audit.excluded) if self.audit is not None else [],
        }
