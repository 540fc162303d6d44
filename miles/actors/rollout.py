"""Rollout worker: plays episodes of prompt groups at known policy versions and publishes trajectories.

A worker runs up to ``rollout.groups_in_flight`` prompt groups at once (or, with ``rollout.admit_by:
episodes``, as many episodes: :mod:`miles.actors.seats`); every episode of every group sends its model turns
to the engine as separate requests, so they batch together and a short episode never waits for a long one.
A group is played with at least the version it was issued at; newer weights switch in at token boundaries
and every model token records its version. Evaluation shards from the controller are played greedily with
the weights pinned at one version.

Delivery contract: a prompt (or evaluation) message is acked only after the trajectory (or result) built
from it is stored by JetStream. A worker killed mid-group leaves its prompts unacked, and JetStream
redelivers them to another worker after ``bus.ack_wait_s``; a worker that stops drains by nak-ing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from nats.aio.msg import Msg

from miles.actors.base import Actor, keep_in_progress
from miles.actors.deliveries import GroupDeliveries
from miles.actors.rollout_stats import RolloutStats
from miles.actors.seats import GroupSeats, Seats
from miles.actors.trust import MAX_VERSION_JUMP
from miles.bus.runinfo import RunInfoError, check_worker_config, wait_run_info
from miles.bus.schema import Episode, EvalShardResult, EvalTask, Heartbeat, PromptGroup, Trajectory, WeightsHeld
from miles.engines.base import SamplingParams, StagingEngine
from miles.heap import freeze_startup_heap
from miles.rollout.env import EpisodeSpec
from miles.rollout.episode import EpisodeLimits, run_episode
from miles.rollout.evaluate import evaluate
from miles.rollout.render import Renderer
from miles.security.signing import SIGNATURE_HEADER
from miles.sync.follower import WeightFollower
from miles.sync.modes import sync_mode
from miles.sync.receiver import WeightReceiver, build_receiver
from miles.tasks.base import Sample, Task

REPORTED_KEEP = 256  # reported versions remembered (a group in flight uses versions far newer than the oldest)


class RolloutWorker(Actor):
    role = "rollout"

    engine: StagingEngine
    weights: WeightReceiver
    follower: WeightFollower  # weights.follower

    def __init__(self, *args: Any, weight_group_rank: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_group_rank = weight_group_rank  # sync.transport 'broadcast': this worker's rank in the group
        self.stats = RolloutStats()
        # Versions reported to the controller as held (WeightsHeld), the newest REPORTED_KEEP. A set, not the
        # newest one: a version switched in and out within one group is reported when that group's trajectory
        # goes out, after the idle reporter may have reported a newer one.
        self._reported: set[int] = set()
        # One reporter at a time: a trajectory may go out only once its versions' reports are *stored*, not
        # merely claimed by the other reporter whose publish is still in flight (found by tests/conformance).
        self._report_lock = asyncio.Lock()
        self.deliveries = GroupDeliveries()  # a prompt redelivered after an outage is not played twice
        self._evaluations = 0  # evaluations pinning the engine's weights now

    def heartbeat(self) -> Heartbeat:
        version = self.engine.version if hasattr(self, "engine") else -1
        stats = {
            **self.stats.as_dict(),
            **self.bus.refusal_stats(),
            "redeliveries_skipped": float(self.deliveries.skipped),
        }
        if hasattr(self, "follower"):
            stats |= self.follower.stats()
        if hasattr(self, "engine"):
            stats |= {
                "engine_load_failures": float(getattr(self.engine, "failures", 0)),
                "engine_error": float(self.engine.error is not None),
            }
            server_stats = getattr(self.engine, "heartbeat_stats", None)  # a server the worker supervises
            if server_stats is not None:
                stats |= server_stats()
        state = "running" if not hasattr(self, "engine") or self.engine.error is None else "engine_error"
        return Heartbeat(role=self.role, actor_id=self.actor_id, version=version, state=state, stats=stats)

    # ------------------------------------------------------------------ set-up

    async def main(self) -> None:
        from miles.engines.registry import build_staging_engine
        from miles.models.loading import load_tokenizer, prepared_model_dir, stop_token_ids
        from miles.tasks.registry import build_task

        cfg = self.cfg
        run_info = await wait_run_info(self.bus.js, self.bus.subjects.run, self.stopping, log=self.log)
        if run_info is None:  # stopped before the controller wrote it
            return
        check_worker_config(run_info, cfg)  # this recipe must be the run's
        instance = await self.bus.run_instance()
        if instance is not None and run_info.run_nonce != instance:
            raise RunInfoError(f"the run info is of run instance {run_info.run_nonce[:8]}..., not {instance[:8]}...")
        model_dir = prepared_model_dir(cfg.model, cfg.task)
        task = build_task(cfg.task, sandbox=cfg.rollout.sandbox)
        await asyncio.to_thread(task.check)
        seed = cfg.seed * 1_000_003 + zlib.crc32(self.actor_id.encode())  # distinct samples per worker
        # Version -1: the engine generates nothing until it holds a published, verified version (even
        # version 0 is fetched: the trainer's rollout-precision weights, not the float32 checkpoint).
        lora = sync_mode(cfg).worker_lora()
        self.engine = await asyncio.to_thread(
            build_staging_engine,
            cfg.rollout.engine,
            model_dir,
            seed,
            work_dir=self.run_dir / "engines" / self.actor_id,
            lora=lora,
        )
        tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        renderer = Renderer(tokenizer, task.render)
        self.weights = await build_receiver(
            cfg, self.bus, self.engine, run_dir=self.run_dir, group_rank=self.weight_group_rank, log=self.log
        )
        self.follower = self.weights.follower
        sampling = cfg.rollout.sampling
        params = SamplingParams(
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop_token_ids=stop_token_ids(tokenizer, model_dir),
        )
        if params.stop_token_ids != run_info.sampling.stop_token_ids:
            raise RunInfoError(
                f"this worker's tokenizer stops at {params.stop_token_ids}, run {cfg.name!r} at "
                f"{run_info.sampling.stop_token_ids}: another model than the run's"
            )
        episode = cfg.rollout.episode
        limits = EpisodeLimits(
            max_turns=episode.max_turns,
            max_tokens=episode.max_tokens,
            timeout_s=episode.timeout_s,
            reward_timeout_s=episode.reward_timeout_s,
            reward_range=cfg.task.reward_range,
            check_template=episode.check_template,
        )
        freeze_startup_heap()  # the engine's model and tokenizer: never walked by the collector again
        await self.engine.start()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.weights.run(self.stopping), name="rollout.weights")
                tg.create_task(self._report_held_versions(), name="rollout.weights_held")
                tg.create_task(self._prompt_loop(task, renderer, params, limits), name="rollout.prompts")
                tg.create_task(self._eval_loop(task, renderer, params, limits), name="rollout.evals")
        finally:
            await self.engine.close()

    # ------------------------------------------------------------------ held-weight reports

    async def _report_held_versions(self) -> None:
        """Report adoptions that happen while idle (a staged version applied between groups)."""
        while not self.stopping.is_set():
            await self._report_held_version()
            await asyncio.sleep(0.2)

    async def _report_held_version(self, used: Iterable[int] = ()) -> None:
        """Tell the controller which versions the engine adopted, with the digest of each one's published
        state, so that a worker running other weights than the trainer published is flagged (WeightsHeld).
        ``used``: the versions a group's tokens came from (a version switched in and out within one group is
        reported too). Called before a trajectory goes out, so a worker that produced anything has reported
        the weights it produced it with."""
        async with self._report_lock:
            for version in sorted({*used, self.engine.version}):
                held = self.follower.staged_versions.get(version)
                if version in self._reported or held is None:
                    continue
                report = WeightsHeld(
                    worker_id=self.actor_id,
                    version=version,
                    state_digest=held.state_digest,
                    mode=held.mode,
                    fetch_bytes=held.fetch_bytes,
                    pause_s=self.engine.last_pause_s,
                )
                await self.bus.publish(self.bus.subjects.weights_held, report)
                self._reported.add(version)
                if len(self._reported) > REPORTED_KEEP:
                    self._reported.remove(min(self._reported))

    # ------------------------------------------------------------------ training rollouts

    def _prompt_refusal(self, group: PromptGroup) -> str | None:
        """A prompt group this worker will not play: another group size than the run's, or issued at a
        version that was never announced (the worker would wait for it forever)."""
        if group.group_size != self.cfg.rollout.group_size:
            return f"group_size {group.group_size}, the run's is {self.cfg.rollout.group_size}"
        latest = self.follower.latest
        newest = latest.version if latest is not None else -1
        if group.issued_at_version > max(newest, 0) + MAX_VERSION_JUMP:
            return f"issued at version {group.issued_at_version}, never announced (newest {newest})"
        return None

    async def _prompt_loop(self, task: Task, renderer: Renderer, params: SamplingParams, limits: EpisodeLimits) -> None:
        """Pull prompt groups while there is room, as many at a time as there is room for: a batch the controller
        just issued starts together, its episodes sharing the engine's forward passes, instead of trickling in
        one fetch (and one prefill) at a time."""
        sub = await self.bus.js.pull_subscribe_bind(
            durable=self.bus.subjects.ROLLOUT_CONSUMER, stream=self.bus.subjects.prompts_stream
        )
        rollout = self.cfg.rollout
        seats = Seats(rollout.groups_in_flight, rollout.group_size)
        try:
            async with asyncio.TaskGroup() as tg:
                while not self.stopping.is_set():
                    free = await seats.take_groups()
                    try:
                        msgs = await sub.fetch(free, timeout=0.5)
                    except asyncio.TimeoutError:
                        msgs = []
                    # nats-py's fetch also hands over what earlier timed-out pulls left queued: more than asked.
                    msgs, surplus = msgs[:free], msgs[free:]
                    for msg in surplus:
                        await msg.nak()  # back to the stream at once, for whichever worker has room
                    await seats.give_back((free - len(msgs)) * rollout.group_size)
                    for msg in msgs:
                        group_seats = GroupSeats(seats, rollout.admit_by)
                        group = await self.bus.accept(msg, PromptGroup)
                        refusal = None if group is None else self._prompt_refusal(group)
                        if refusal is not None:
                            await self.bus.refuse(msg, f"prompt_group: {refusal}", category="untrusted")
                        if group is None or refusal is not None:
                            await group_seats.release()
                            continue
                        claim = self.deliveries.claim(group.group_id, msg)
                        if claim != "play":  # redelivered: held until the group in play is stored, or acked now
                            if claim == "stored":
                                await msg.ack()
                            await group_seats.release()
                            continue
                        tg.create_task(self._play_group(msg, group, task, renderer, params, limits, group_seats))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _play_group(
        self,
        msg: Msg,
        group: PromptGroup,
        task: Task,
        renderer: Renderer,
        params: SamplingParams,
        limits: EpisodeLimits,
        seats: GroupSeats,
    ) -> None:
        stored = False
        try:
            async with keep_in_progress([msg], period_s=self.cfg.bus.ack_wait_s / 3):
                # Staleness contract: play with at least the version the controller issued the group at.
                if not await self.follower.wait_for(group.issued_at_version, self.stopping):
                    await msg.nak()  # stopping: another worker takes it at once
                    return
                if not await self._wait_out_evaluations():
                    await msg.nak()
                    return
                spec = EpisodeSpec(group.sample_id, group.prompt, group.answer, group.meta)

                async def play_one() -> Episode:
                    episode = await run_episode(
                        self.engine, renderer, task.environment(spec), params, limits, sample_id=spec.sample_id
                    )
                    await seats.episode_done()  # admit_by: episodes: its seat takes the next group's episode
                    return episode

                start = time.perf_counter()
                episodes = await _until_stopped(
                    self.stopping, asyncio.gather(*(play_one() for _ in range(group.group_size)))
                )
                if episodes is None:
                    await msg.nak()
                    return
                gen_s = time.perf_counter() - start
                await self._report_held_version(v for ep in episodes for _, v in ep.spans)
                traj = Trajectory(
                    group_id=group.group_id,
                    sample_id=group.sample_id,
                    worker_id=self.actor_id,
                    episodes=list(episodes),
                    issued_at_version=group.issued_at_version,
                    gen_s=gen_s,
                    # The group as issued, so the trainer can check the controller issued it (docs/security.md).
                    ticket=msg.data,
                    ticket_signature=(msg.headers or {}).get(SIGNATURE_HEADER, ""),
                )
                await self.bus.publish(self.bus.subjects.traj, traj)  # durable first...
                stored = True
                await msg.ack()  # ...then the prompt may go
                self.stats.add_group(traj)
        finally:
            for held in self.deliveries.finish(group.group_id, stored=stored):  # redeliveries held meanwhile
                await (held.ack() if stored else held.nak())
            await seats.release()

    async def _wait_out_evaluations(self) -> bool:
        """Hold a group while an evaluation pins weights too old to start it with (:func:`holds_for_evaluation`);
        False if the worker is stopping meanwhile."""
        held = False
        while self.cfg.eval.hold_rollouts:
            latest = self.follower.latest
            if not holds_for_evaluation(
                evaluating=self._evaluations > 0,
                engine_version=self.engine.version,
                newest_announced=-1 if latest is None else latest.version,
            ):
                break
            if not held:
                held = True
                self.stats.groups_held_for_eval += 1
            if await self.sleep_unless_stopping(0.05):
                return False
        return True

    # ------------------------------------------------------------------ evaluation

    async def _eval_loop(self, task: Task, renderer: Renderer, params: SamplingParams, limits: EpisodeLimits) -> None:
        sub = await self.bus.js.pull_subscribe_bind(
            durable=self.bus.subjects.ROLLOUT_EVAL_CONSUMER, stream=self.bus.subjects.evalq_stream
        )
        try:
            while not self.stopping.is_set():
                try:
                    (msg,) = await sub.fetch(1, timeout=0.5)
                except asyncio.TimeoutError:
                    continue
                work = await self.bus.accept(msg, EvalTask)
                if work is not None:
                    await self._evaluate(msg, work, task, renderer, params, limits)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _evaluate(
        self, msg: Msg, work: EvalTask, task: Task, renderer: Renderer, params: SamplingParams, limits: EpisodeLimits
    ) -> None:
        """One shard, greedy, at one version >= the requested one (weights pinned while it runs)."""
        async with keep_in_progress([msg], period_s=self.cfg.bus.ack_wait_s / 3):
            if not await self.follower.wait_for(work.version, self.stopping):
                await msg.nak()
                return
            while self.engine.version < work.version:  # staged: switched in at the engine's next boundary
                if await self.sleep_unless_stopping(0.01):
                    await msg.nak()
                    return
            samples = [
                Sample(id=s["sample_id"], prompt=s["prompt"], answer=s.get("answer", ""), meta=s.get("meta", {}))
                for s in work.samples
            ]
            self._evaluations += 1
            try:
                async with self.engine.pinned() as version:
                    outcome = await _until_stopped(
                        self.stopping,
                        evaluate(
                            self.engine,
                            renderer,
                            task,
                            samples,
                            replace(params, max_new_tokens=work.max_new_tokens),
                            limits,
                        ),
                    )
            finally:
                self._evaluations -= 1
            if outcome is None:
                await msg.nak()
                return
            result = EvalShardResult(
                eval_id=work.eval_id,
                shard=work.shard,
                worker_id=self.actor_id,
                version=version,
                samples=outcome.samples,
                reward_sum=outcome.reward_sum,
                failed=outcome.failed + outcome.infra,
                tokens=outcome.tokens,
                claim=work.claim,
            )
            # One message id per shard: a shard played again (its ack lost in an outage, so redelivered) is
            # dropped by the stream instead of reaching the controller as a second result, refused there. The
            # claim in it is what only the shard's receivers know, so nobody else can take the id first.
            msg_id = f"evalres-{work.eval_id}-{work.shard}-{work.claim}"
            await self.bus.publish(self.bus.subjects.eval_results, result, msg_id=msg_id, by_content=False)
            await msg.ack()
            self.stats.evals += 1


def holds_for_evaluation(*, evaluating: bool, engine_version: int, newest_announced: int) -> bool:
    """Whether a rollout group must wait before it starts: an evaluation pins the engine's weights (no newer
    version switches in until it ends) and a newer version is already announced. The group would be played on
    those weights while the trainer moves on, on the groups before it, so it tends to arrive past the
    staleness bound and be issued again (measured: waiting only once the pinned weights were max_staleness
    behind still lost 6% of groups; waiting at one version behind, none). Its generation is better spent on
    the evaluation, which then ends sooner. Not pinned, the engine switches at its next token boundary, so
    a group never waits for an ordinary weight fetch (asynchrony is kept)."""
    return evaluating and newest_announced > engine_version


async def _until_stopped(stopping: asyncio.Event, work: Any) -> Any:
    """``await work`` unless the actor is asked to stop first (then the work is cancelled: None)."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
