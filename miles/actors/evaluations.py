"""Held-out evaluations, owned by the controller and played by rollout workers.

When a version is due (the first, every ``eval.every`` steps, the last), the controller splits the eval
split into shards of ``eval.shard_size`` samples and puts them on the EVALQ work queue; any worker takes a
shard, plays it greedily with its weights pinned at one version >= the requested one, and publishes an
:class:`~miles.bus.schema.EvalShardResult`. When every shard of an evaluation is in, the controller
publishes the :class:`~miles.bus.schema.EvalResult` and records it. The trainer builds no model for it and
never waits for it. Shards and results carry the evaluation id (``v<version>``) and their shard index, so a
re-sent shard (a controller restart, a redelivery) is recognised and counted once.

After a controller restart the coordinator is rebuilt from the streams: completed evaluations from the
EvalResults on METRICS (:meth:`EvalCoordinator.mark_completed`), shard results from EVENTS; a shard result of
an evaluation this controller did not request itself is taken when its version was announced (the earlier
life requested it), its shard sizes being a pure function of the held-out split and the shard size.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from miles.bus.client import Bus
from miles.bus.schema import EvalResult, EvalShardResult, EvalTask
from miles.tasks.base import Sample

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Pending:
    version: int
    sizes: list[int]  # samples per shard, as issued
    results: dict[int, EvalShardResult] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: EvalResult | None = None
    requested: bool = False  # shards published by this controller (not only restored from the streams)


class EvalCoordinator:
    """Issues evaluation shards and folds their results into one :class:`EvalResult` per evaluation."""

    def __init__(
        self,
        bus: Bus,
        samples: list[Sample],
        *,
        every: int,
        shard_size: int,
        max_new_tokens: int,
        announced: Callable[[int], bool] = lambda _: False,
    ) -> None:
        self.bus = bus
        self.announced = announced  # whether a version was announced (an earlier life may have requested it)
        self.samples = samples
        self.every = every
        self.shard_size = shard_size
        self.max_new_tokens = max_new_tokens
        self.pending: dict[str, _Pending] = {}

    def due(self, step: int, last_step: int) -> bool:
        """Evaluate the version of ``step``: the first, every ``every`` steps, and the last."""
        return step == 0 or step == last_step or (self.every > 0 and step % self.every == 0)

    def _chunks(self) -> list[list[Sample]]:
        return [self.samples[i : i + self.shard_size] for i in range(0, len(self.samples), self.shard_size)]

    def _restored(self, eval_id: str, version: int) -> _Pending:
        """The pending evaluation of ``version``, made without publishing (known from the streams)."""
        if eval_id not in self.pending:
            self.pending[eval_id] = _Pending(version, [len(c) for c in self._chunks()])
        return self.pending[eval_id]

    def completed(self, version: int) -> bool:
        pending = self.pending.get(f"v{version}")
        return pending is not None and pending.done.is_set()

    def mark_completed(self, result: EvalResult) -> None:
        """An evaluation whose result is on the METRICS stream (published by this controller or an earlier life)."""
        eval_id = result.eval_id or f"v{result.requested_version}"
        pending = self._restored(eval_id, result.requested_version)
        pending.result = pending.result or result
        pending.done.set()

    async def request(self, version: int) -> str:
        """Put the shards of an evaluation of ``version`` on the work queue (idempotent per version, and across
        controller restarts by message id)."""
        eval_id = f"v{version}"
        if eval_id in self.pending and (self.pending[eval_id].requested or self.pending[eval_id].done.is_set()):
            return eval_id
        chunks = self._chunks()
        pending = self._restored(eval_id, version)
        pending.requested = True
        for shard, chunk in enumerate(chunks):
            task = EvalTask(
                eval_id=eval_id,
                version=version,
                shard=shard,
                shards=len(chunks),
                samples=[{"sample_id": s.id, "prompt": s.prompt, "answer": s.answer, "meta": s.meta} for s in chunk],
                max_new_tokens=self.max_new_tokens,
            )
            # The message id makes a re-sent shard (a controller restarted mid-issue) a no-op in the stream.
            await self.bus.publish(self.bus.subjects.evalq, task, msg_id=f"{eval_id}-{shard}")
        log.info("eval_requested", eval_id=eval_id, version=version, shards=len(chunks), samples=len(self.samples))
        return eval_id

    def refusal(self, result: EvalShardResult) -> str | None:
        """Why ``result`` cannot be counted (None: it can): an evaluation never issued, a shard out of range
        or counted already, another sample count than the shard's, a version older than requested, a sum
        that is not finite."""
        pending = self.pending.get(result.eval_id)
        if pending is None and result.eval_id[1:].isdigit() and self.announced(int(result.eval_id[1:])):
            pending = self._restored(result.eval_id, int(result.eval_id[1:]))  # requested by an earlier life
        if pending is None:
            return f"eval {result.eval_id!r} was never requested"
        if result.shard >= len(pending.sizes) or result.shard in pending.results:
            return f"shard {result.shard} of {result.eval_id} is out of range or counted already"
        if result.samples != pending.sizes[result.shard] or result.failed > result.samples:
            expected = pending.sizes[result.shard]
            return f"shard {result.shard} of {result.eval_id} has {expected} samples, not {result.samples}"
        if result.version < pending.version:
            return f"{result.eval_id} evaluated at version {result.version}, older than requested"
        if not math.isfinite(result.reward_sum):
            return "reward_sum is not finite"
        return None

    async def on_result(self, result: EvalShardResult) -> EvalResult | None:
        """Fold one shard's result (already checked by :meth:`refusal`); returns the evaluation's result once
        its last shard is in."""
        pending = self.pending[result.eval_id]
        pending.results[result.shard] = result
        if len(pending.results) < len(pending.sizes) or pending.done.is_set():
            return None  # more shards to come, or completed already (its result is on METRICS)
        parts = list(pending.results.values())
        samples = sum(r.samples for r in parts)
        pending.result = EvalResult(
            policy_version=min(r.version for r in parts),
            accuracy=sum(r.reward_sum for r in parts) / samples if samples else 0.0,
            samples=samples,
            requested_version=pending.version,
            eval_id=result.eval_id,
            failed=sum(r.failed for r in parts),
            tokens=sum(r.tokens for r in parts),
        )
        await self.bus.publish(self.bus.subjects.eval, pending.result, msg_id=f"eval-{result.eval_id}")
        pending.done.set()
        log.info("eval", version=pending.version, accuracy=round(pending.result.accuracy, 4), samples=samples)
        return pending.result

    async def wait(self, eval_id: str, timeout_s: float | None = None) -> EvalResult | None:
        """The evaluation's result once complete (None if ``timeout_s`` passes first)."""
        pending = self.pending[eval_id]
        try:
            await asyncio.wait_for(pending.done.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        return pending.result

    def stats(self) -> dict[str, Any]:
        return {"evals_pending": float(sum(not p.done.is_set() for p in self.pending.values()))}
