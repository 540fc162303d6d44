"""Trainer leader (rank 0): consume trajectories, train, checkpoint, publish weights, then ack.

Order of one step, chosen so that a crash at any point loses nothing and trains nothing twice:

1. collect ``groups_per_step`` fresh trajectories (unacked; too-stale ones are discarded and acked);
2. one optimizer step over all ranks;
3. checkpoint model + optimizer + version + the ids of every trained group + the step's metrics;
4. put the new weights in the data plane and announce them, then publish the step's metrics;
5. ack the step's trajectories.

A restart resumes from (3): it re-announces the checkpoint's weights if (4) did not happen,
re-sends the step's metrics (deduplicated by message id), and acks-and-skips redelivered
trajectories whose group id the checkpoint lists as trained.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.msg import Msg

from miles.actors.base import Actor, keep_in_progress
from miles.actors.trainer_ranks import LeaderRanks
from miles.bus.client import KEY_TRAINER_VERSION
from miles.bus.dataplane import WeightStore
from miles.bus.schema import (
    EvalResult,
    GroupsDiscarded,
    Heartbeat,
    StepMetrics,
    TrainerDone,
    Trajectory,
    decode,
    encode,
)
from miles.sync.publisher import WeightPublisher, delta_keep_versions


class TrainerLeader(Actor):
    role = "trainer"

    def __init__(self, *args: Any, ranks: LeaderRanks, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ranks = ranks
        self.version = 0
        self.trained_ids: set[str] = set()
        self.discarded_ids: set[str] = set()  # a late duplicate of a discarded group is not trained either
        self.dropped = 0
        self.requeued = 0
        self.duplicates = 0
        self.checkpoint_path = self.run_dir / "checkpoints" / "trainer.pt"
        self._resent_step: bytes | None = None

    def heartbeat(self) -> Heartbeat:
        stats = {
            "trained_groups": float(len(self.trained_ids)),
            "dropped": float(self.dropped),
            "requeued": float(self.requeued),
            "duplicates": float(self.duplicates),
            "dead_lettered": float(self.bus.dead_lettered),
        }
        return Heartbeat(role=self.role, actor_id=self.actor_id, version=self.version, stats=stats)

    # ------------------------------------------------------------------ main loop

    async def main(self) -> None:
        from miles.actors.evaluator import Evaluator

        cfg = self.cfg
        self.store = await WeightStore.create(
            self.bus.js, self.bus.subjects.run, replicas=cfg.bus.replicas, keep_versions=cfg.sync.keep_versions
        )
        delta_store = None
        if cfg.sync.mode == "delta":
            delta_store = await WeightStore.create(
                self.bus.js,
                self.bus.subjects.run,
                replicas=cfg.bus.replicas,
                keep_versions=delta_keep_versions(cfg.sync.keep_versions, cfg.sync.anchor_every),
                kind="delta",
            )
        # Keeps the last published state in memory (delta mode): after a restart the first publish is a full anchor.
        self.publisher = WeightPublisher(
            self.bus,
            self.store,
            cfg.sync.dtype,
            mode=cfg.sync.mode,
            delta_store=delta_store,
            anchor_every=cfg.sync.anchor_every,
        )
        self.evaluator = await self.ranks.run(Evaluator.create, cfg)
        fresh = await self._restore()
        weights = await self._export()
        if await self.bus.get_int(KEY_TRAINER_VERSION, -1) < self.version:
            await self.publisher.publish(weights, self.version)
        if self._resent_step is not None:  # the crash may have come before the step's report went out
            await self._publish_step(decode(self._resent_step, StepMetrics))
        if fresh:
            await self._evaluate(weights)

        sub = await self.bus.js.pull_subscribe_bind(
            durable=self.bus.subjects.TRAINER_CONSUMER, stream=self.bus.subjects.traj_stream
        )
        last_step_end = time.perf_counter()
        try:
            while self.version < cfg.trainer.steps and not self.stopping.is_set():
                collected = await self._collect(sub)
                if collected is None:
                    break  # stopping: the held trajectories were nak'ed for redelivery
                msgs, trajs = collected
                metrics = await self._train(trajs)
                step_s = time.perf_counter() - last_step_end
                last_step_end = time.perf_counter()
                await self._finish_step(msgs, trajs, metrics, step_s)
        finally:
            await sub.unsubscribe()
        if self.version >= cfg.trainer.steps:
            weights = await self._export()
            if cfg.trainer.eval_every == 0 or self.version % cfg.trainer.eval_every:
                await self._evaluate(weights)
            await self.bus.publish(self.bus.subjects.done, TrainerDone(policy_version=self.version, steps=self.version))
            self.log.info("trainer_done", version=self.version)
        await self.ranks.stop()

    async def _restore(self) -> bool:
        """Load the checkpoint if there is one; returns True for a fresh start."""
        if not self.checkpoint_path.exists():
            return True
        extra = await self.ranks.call("load_checkpoint", str(self.checkpoint_path))
        self.version = int(extra["policy_version"])
        self.trained_ids = set(extra["trained_group_ids"])
        self.discarded_ids = set(extra.get("discarded_group_ids", []))
        self._resent_step = extra.get("last_step_metrics")
        self.log.info("trainer_resumed", version=self.version, trained_groups=len(self.trained_ids))
        return False

    async def _export(self) -> dict:
        """The state to publish (and evaluate): the weights in rollout precision, or in LoRA mode only
        the adapter. FP8/FP4 are quantized here, so workers run exactly these codes and scales."""
        import torch

        from miles.sync.precision import is_quantized, to_rollout_state

        sync = self.cfg.sync
        if sync.mode == "lora":
            return await self.ranks.call("export_adapter", getattr(torch, sync.dtype))
        if is_quantized(sync.dtype):
            master = await self.ranks.call("export_weights", torch.float32)
            return await asyncio.to_thread(to_rollout_state, master, sync.dtype)
        return await self.ranks.call("export_weights", getattr(torch, sync.dtype))

    # ------------------------------------------------------------------ collecting

    async def _collect(self, sub: Any) -> tuple[list[Msg], list[Trajectory]] | None:
        """Pull until a full batch of fresh, untrained trajectories is held (unacked)."""
        want = self.cfg.trainer.groups_per_step
        msgs: list[Msg] = []
        trajs: list[Trajectory] = []
        async with keep_in_progress(msgs, period_s=self.cfg.bus.ack_wait_s / 3):
            while len(trajs) < want:
                if self.stopping.is_set():
                    for m in msgs:
                        await m.nak()
                    return None
                try:
                    batch = await sub.fetch(want - len(trajs), timeout=0.5)
                except asyncio.TimeoutError:
                    continue
                for m in batch:
                    traj = await self.bus.decode_or_dead_letter(m, Trajectory)
                    if traj is None:
                        continue
                    seen = traj.group_id in self.trained_ids or traj.group_id in self.discarded_ids
                    if seen or any(t.group_id == traj.group_id for t in trajs):
                        self.duplicates += 1
                        await m.ack()
                        continue
                    if self.version - traj.oldest_version > self.cfg.staleness.max_staleness:
                        await self._discard(m, traj)
                        continue
                    msgs.append(m)
                    trajs.append(traj)
        return msgs, trajs

    async def _discard(self, msg: Msg, traj: Trajectory) -> None:
        requeue = self.cfg.staleness.on_stale == "requeue"
        event = GroupsDiscarded(
            group_ids=[traj.group_id], sample_ids=[traj.sample_id], requeue=requeue, trainer_version=self.version
        )
        await self.bus.publish(self.bus.subjects.discarded, event)  # recorded durably before the ack
        self.discarded_ids.add(traj.group_id)
        await msg.ack()
        if requeue:
            self.requeued += 1
        else:
            self.dropped += 1
        self.log.info(
            "trajectory_discarded",
            group=traj.group_id,
            version=traj.oldest_version,
            trainer_version=self.version,
            requeue=requeue,
        )

    # ------------------------------------------------------------------ training

    async def _train(self, trajs: list[Trajectory]) -> dict[str, float]:
        import torch

        from miles.algo.advantages import group_advantages
        from miles.backends.base import TrainSample

        world = self.ranks.world_size
        per_rank = len(trajs) // world
        shards: list[list[TrainSample]] = [[] for _ in range(world)]
        for i, traj in enumerate(trajs):
            rewards = [c.reward for c in traj.completions]
            advantages = group_advantages(torch.tensor(rewards), self.cfg.trainer.algo.advantage).tolist()
            shard = shards[min(i // per_rank, world - 1)]
            for comp, adv in zip(traj.completions, advantages, strict=True):
                shard.append(
                    TrainSample(
                        prompt_ids=traj.prompt_ids,
                        output_ids=comp.output_ids,
                        behaviour_logprobs=comp.logprobs,
                        advantage=float(adv),
                        weight_version=comp.weight_version,
                    )
                )
        result = await self.ranks.train_step(shards)
        return dict(result.metrics)

    async def _finish_step(
        self, msgs: list[Msg], trajs: list[Trajectory], metrics: dict[str, float], step_s: float
    ) -> None:
        staleness = [self.version - t.oldest_version for t in trajs]
        step = self.version
        self.version += 1
        self.trained_ids.update(t.group_id for t in trajs)
        weights = await self._export()
        every = self.cfg.trainer.eval_every
        if every and self.version % every == 0:
            metrics["eval_accuracy"] = await self._evaluate(weights)
        rewards = [c.reward for t in trajs for c in t.completions]
        tokens = sum(t.num_tokens for t in trajs)
        metrics |= {
            "reward_mean": sum(rewards) / len(rewards),
            "step_s": step_s,
            "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "samples": float(len(rewards)),
        }
        step_metrics = StepMetrics(
            step=step,
            policy_version=self.version,
            metrics=metrics,
            trained_group_ids=[t.group_id for t in trajs],
            staleness=staleness,
        )
        # The step's report travels inside the checkpoint, so a restart can re-send it if we die below.
        extra = {
            "policy_version": self.version,
            "trained_group_ids": sorted(self.trained_ids),
            "discarded_group_ids": sorted(self.discarded_ids),
            "last_step_metrics": encode(step_metrics),
        }
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        await self.ranks.call("save_checkpoint", str(self.checkpoint_path), extra)
        await self.publisher.publish(weights, self.version)
        await self._publish_step(step_metrics)
        for m in msgs:
            await m.ack_sync()
        self.log.info(
            "step",
            step=step,
            version=self.version,
            reward=round(metrics["reward_mean"], 3),
            staleness_max=max(staleness),
        )

    async def _publish_step(self, step_metrics: StepMetrics) -> None:
        """Publish a step's metrics; the message id makes a re-send after a restart a no-op."""
        await self.bus.js.publish(
            self.bus.subjects.step, encode(step_metrics), headers={"Nats-Msg-Id": f"step-{step_metrics.step}"}
        )

    async def _evaluate(self, weights: dict) -> float:
        accuracy, n = await self.ranks.run(self.evaluator.evaluate, weights, self.version)
        await self.bus.publish(
            self.bus.subjects.eval, EvalResult(policy_version=self.version, accuracy=accuracy, samples=n)
        )
        self.log.info("eval", version=self.version, accuracy=round(accuracy, 4))
        return accuracy
