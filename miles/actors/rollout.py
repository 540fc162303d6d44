"""Rollout worker: pull prompt groups, generate at known policy versions, score, publish trajectories.

A group is generated with at least the version it was issued at; newer weights that arrive while
it generates switch in at a token boundary, and each completion records its version spans.

Delivery contract: a prompt message is acked only after the trajectory built from it has been
stored by JetStream. A worker killed mid-batch leaves its prompts unacked, and JetStream
redelivers them to another worker after ``bus.ack_wait_s``.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from miles.actors.base import Actor, keep_in_progress
from miles.bus.dataplane import WeightStore
from miles.bus.schema import Completion, Heartbeat, PromptGroup, Trajectory
from miles.engines.base import SamplingParams, StagingEngine
from miles.sync.follower import WeightFollower
from miles.sync.publisher import delta_keep_versions
from miles.tasks.base import Sample, Task


class RolloutWorker(Actor):
    role = "rollout"

    engine: StagingEngine
    follower: WeightFollower

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups_done = 0
        self.tokens_done = 0
        self.busy_s = 0.0

    def heartbeat(self) -> Heartbeat:
        version = self.engine.version if hasattr(self, "engine") else -1
        stats = {
            "groups": float(self.groups_done),
            "tokens": float(self.tokens_done),
            "busy_s": self.busy_s,
            "dead_lettered": float(self.bus.dead_lettered),
        }
        if hasattr(self, "follower"):
            stats |= {
                "syncs": float(self.follower.syncs),
                "checksum_failures": float(self.follower.checksum_failures),
                "last_pause_ms": self.follower.last_pause_s * 1e3,
                "last_fetch_ms": self.follower.last_fetch_s * 1e3,
                "delta_fallbacks": float(self.follower.delta_fallbacks),
                "last_fetch_bytes": float(self.follower.last_fetch_bytes),
                "fetched_bytes": float(self.follower.fetched_bytes),
                "fetches": float(self.follower.fetches),
            }
        return Heartbeat(role=self.role, actor_id=self.actor_id, version=version, stats=stats)

    async def main(self) -> None:
        from miles.engines.registry import build_engine
        from miles.models.loading import encode_prompt, load_tokenizer, resolve_model_dir, stop_token_ids
        from miles.tasks.registry import build_task

        model_dir = await asyncio.to_thread(resolve_model_dir, self.cfg.model, self.cfg.task)
        seed = self.cfg.seed * 1_000_003 + zlib.crc32(self.actor_id.encode())  # distinct samples per worker
        self.engine = await asyncio.to_thread(build_engine, self.cfg.rollout.engine, model_dir, 0, seed)
        tokenizer = self.tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        task = build_task(self.cfg.task)
        store = await WeightStore.create(
            self.bus.js,
            self.bus.subjects.run,
            replicas=self.cfg.bus.replicas,
            keep_versions=self.cfg.sync.keep_versions,
        )
        delta_store = None
        if self.cfg.sync.mode == "delta":
            delta_store = await WeightStore.create(
                self.bus.js,
                self.bus.subjects.run,
                replicas=self.cfg.bus.replicas,
                keep_versions=delta_keep_versions(self.cfg.sync.keep_versions, self.cfg.sync.anchor_every),
                kind="delta",
            )
        self.follower = WeightFollower(self.bus, store, self.engine, delta_store=delta_store)
        sampling = self.cfg.rollout.sampling
        params = SamplingParams(
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop_token_ids=stop_token_ids(tokenizer),
        )
        sub = await self.bus.js.pull_subscribe_bind(
            durable=self.bus.subjects.ROLLOUT_CONSUMER, stream=self.bus.subjects.prompts_stream
        )
        follower_task = asyncio.create_task(self.follower.run(self.stopping), name="rollout.weights")
        try:
            while not self.stopping.is_set():
                if follower_task.done():
                    follower_task.result()  # re-raise: a dead follower must fail the worker loudly
                try:
                    msgs = await sub.fetch(self.cfg.rollout.groups_per_batch, timeout=0.5)
                except asyncio.TimeoutError:
                    self.follower.apply_staged()  # idle: a good moment to swap
                    continue
                await self._process(msgs, task, params, lambda text: encode_prompt(tokenizer, text))
        finally:
            follower_task.cancel()
            await asyncio.gather(follower_task, return_exceptions=True)
            await sub.unsubscribe()

    async def _process(
        self, msgs: list[Msg], task: Task, params: SamplingParams, encode: Callable[[str], list[int]]
    ) -> None:
        groups: list[tuple[Msg, PromptGroup]] = []
        for m in msgs:
            group = await self.bus.decode_or_dead_letter(m, PromptGroup)
            if group is not None:
                groups.append((m, group))
        if not groups:
            return
        held = [m for m, _ in groups]
        async with keep_in_progress(held, period_s=self.cfg.bus.ack_wait_s / 3):
            # Staleness contract: generate with at least the version the controller issued the group at.
            needed = max(g.issued_at_version for _, g in groups)
            if not await self.follower.wait_for(needed, self.stopping):
                return  # stopping: leave the prompts unacked so another worker gets them
            # generate() first applies what is staged (>= needed), so every token is at >= the floor;
            # weights staged while it runs switch in at a token boundary (recorded in version_spans).
            prompt_ids = [encode(g.prompt) for _, g in groups]
            size = self.cfg.rollout.group_size
            batch = [ids for ids in prompt_ids for _ in range(size)]
            start = time.perf_counter()
            gens = await asyncio.to_thread(self.engine.generate, batch, params)
            gen_s = time.perf_counter() - start
            self.busy_s += gen_s
            for i, (m, g) in enumerate(groups):
                sample = Sample(id=g.sample_id, prompt=g.prompt, answer=g.answer)
                completions = []
                for gen in gens[i * size : (i + 1) * size]:
                    text = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
                    completions.append(
                        Completion(
                            output_ids=gen.output_ids,
                            logprobs=gen.logprobs,
                            reward=float(task.reward(text, sample)),
                            finish_reason=gen.finish_reason,
                            weight_version=gen.weight_version,
                            version_spans=[[index, version] for index, version in gen.version_spans],
                        )
                    )
                traj = Trajectory(
                    group_id=g.group_id,
                    sample_id=g.sample_id,
                    worker_id=self.actor_id,
                    prompt_ids=prompt_ids[i],
                    completions=completions,
                    issued_at_version=g.issued_at_version,
                    gen_s=gen_s,
                )
                await self.bus.publish(self.bus.subjects.traj, traj)  # durable first...
                await m.ack()  # ...then the prompt may go
                self.groups_done += 1
                self.tokens_done += traj.num_tokens
