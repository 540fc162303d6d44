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
from collections.abc import Callable, Iterable
from typing import Any

from nats.aio.msg import Msg

from miles.actors.base import Actor, keep_in_progress
from miles.bus.dataplane import WeightStore
from miles.bus.schema import Completion, Heartbeat, PromptGroup, Trajectory, WeightsHeld
from miles.engines.base import SamplingParams, StagingEngine
from miles.sync.engine_weights import EngineWeights
from miles.sync.follower import WeightFollower
from miles.sync.lora import lora_scale
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
        self._reported_version = -1  # newest version announced to the controller as held (WeightsHeld)

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
                "sparse_stages": float(self.follower.sparse_stages),
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
        # Version -1: the engine generates nothing until it holds a published, verified version (even
        # version 0 is fetched: the trainer's rollout-precision weights, not the float32 checkpoint).
        self.engine = await asyncio.to_thread(build_engine, self.cfg.rollout.engine, model_dir, -1, seed)
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
        self.engine, decoder = self._weight_path(self.engine, model_dir)
        self.follower = WeightFollower(self.bus, store, self.engine, delta_store=delta_store, decoder=decoder)
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
        report_task = asyncio.create_task(self._report_held_versions(), name="rollout.weights_held")
        try:
            while not self.stopping.is_set():
                for background in (follower_task, report_task):
                    if background.done():
                        background.result()  # re-raise: a dead follower or reporter must fail the worker loudly
                try:
                    msgs = await sub.fetch(self.cfg.rollout.groups_per_batch, timeout=0.5)
                except asyncio.TimeoutError:
                    self.follower.apply_staged()  # idle: a good moment to swap
                    continue
                await self._process(msgs, task, params, lambda text: encode_prompt(tokenizer, text))
        finally:
            for background in (follower_task, report_task):
                background.cancel()
            await asyncio.gather(follower_task, report_task, return_exceptions=True)
            await sub.unsubscribe()

    def _weight_path(self, engine: Any, model_dir: Any) -> tuple[StagingEngine, EngineWeights]:
        """The engine the follower stages into, and how published states become its weights.

        The torch engine takes tensors: dequantized FP8/FP4, or in LoRA mode the adapted modules merged on
        the frozen base. An SGLang server loads from disk: wrapped in :class:`SglangStagingEngine`, it
        gets whole checkpoints, or in LoRA mode the adapter itself (a versioned /load_lora_adapter).
        """
        from miles.engines.sglang_engine import SglangEngine
        from miles.engines.sglang_staging import SglangStagingEngine

        lora = self.cfg.trainer.lora if self.cfg.sync.mode == "lora" else None
        if isinstance(engine, SglangEngine):
            engine_cfg = self.cfg.rollout.engine
            weights_dir = getattr(engine_cfg, "adapter_dir", None) or self.run_dir / "weights" / self.actor_id
            staging = SglangStagingEngine(engine, weights_dir, lora=lora, model_dir=model_dir)
            return staging, EngineWeights(
                dict, precision=self.cfg.sync.dtype, adapters="passthrough" if lora is not None else "merge"
            )
        return engine, EngineWeights(
            engine.model.state_dict,
            precision=self.cfg.sync.dtype,
            lora_scale=None if lora is None else lora_scale(lora),
        )

    async def _report_held_versions(self) -> None:
        """Report adoptions that happen while idle (a staged version applied between batches)."""
        while not self.stopping.is_set():
            await self._report_held_version()
            await asyncio.sleep(0.2)

    async def _report_held_version(self, used: Iterable[int] = ()) -> None:
        """Tell the controller which versions the engine adopted, with the digest of each one's published
        state, so that a worker running other weights than the trainer published is flagged (WeightsHeld).
        ``used``: the versions a generation's tokens came from (a version switched in and out within one
        batch is reported too). Called after every generation, before its trajectories go out, so a worker
        that produced anything has reported the weights it produced it with."""
        for version in sorted({*used, self.engine.version}):
            held = self.follower.staged_versions.get(version)
            if version <= self._reported_version or held is None:
                continue
            self._reported_version = version  # first: the idle loop and a batch never report one twice
            report = WeightsHeld(
                worker_id=self.actor_id,
                version=version,
                state_digest=held.state_digest,
                mode=held.mode,
                fetch_bytes=held.fetch_bytes,
                pause_s=self.engine.last_pause_s,
            )
            await self.bus.publish(self.bus.subjects.weights_held, report)

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
            await self._report_held_version(v for gen in gens for _, v in gen.version_spans)
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
