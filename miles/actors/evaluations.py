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
an evaluation this controller did not request itself is taken when its version was announced at a step whose
evaluation was due (the earlier life requested it), its shard sizes being a pure function of the held-out
split and the shard size.

What a shard result must be to count (a rollout identity is not trusted, docs/security.md): for an
evaluation the controller requested, carrying the shard's *claim* (a token only the task's receivers learn,
derived from the controller's key: a worker that did not take the shard, or a replay of an earlier run, cannot
answer it), once, with a reward sum the task's ``reward_range`` allows. A refused result that carried the claim
came from whoever took the shard, so the shard is issued again (at most ``MAX_REISSUES`` times) and the
evaluation still completes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from miles.bus.client import Bus
from miles.bus.schema import EvalResult, EvalShardResult, EvalTask, EvaluationPart
from miles.tasks.base import Sample

log = structlog.get_logger(__name__)

MAX_REISSUES = 3  # per shard: a thief of shards cannot make the controller publish without end


@dataclass(slots=True)
class _Pending:
    version: int
    sizes: list[int]  # samples per shard, as issued
    results: dict[int, EvalShardResult] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: EvalResult | None = None
    requested: bool = False  # shards published by this controller (not only restored from the streams)
    reissued: dict[int, int] = field(default_factory=dict)  # shard -> times issued again after a refused result
    counted: set[int] = field(default_factory=set)  # shards counted whose results were let go (once complete)

    def has(self, shard: int) -> bool:
        """Whether ``shard``'s result is counted already."""
        return shard in self.results or shard in self.counted

    def part(self, eval_id: str) -> EvaluationPart:
        """This evaluation as a part of the controller's snapshot: a complete one keeps its result and which
        shards it counted, not their results (a snapshot stays small however many evaluations a run had)."""
        done = self.result is not None and self.done.is_set()
        return EvaluationPart(
            eval_id=eval_id,
            version=self.version,
            sizes=list(self.sizes),
            results=[] if done else list(self.results.values()),
            counted=sorted(self.counted | set(self.results)) if done else sorted(self.counted),
            reissued=sorted(self.reissued.items()),
            result=self.result if done else None,
        )

    @classmethod
    def from_part(cls, part: EvaluationPart) -> _Pending:
        pending = cls(part.version, list(part.sizes), {r.shard: r for r in part.results})
        pending.counted = set(part.counted)
        pending.reissued = dict(part.reissued)
        if part.result is not None:
            pending.result = part.result
            pending.done.set()
        return pending


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
        claim_key: bytes,
        last_step: int,
        reward_range: tuple[float, float] | None = None,
        step_of: Callable[[int], int | None] = lambda _: None,
    ) -> None:
        self.bus = bus
        self.step_of = step_of  # the step an announced version was published at (None: never announced)
        self.last_step = last_step
        self.reward_range = reward_range
        self._claim_key = hashlib.sha256(b"miles.eval-claim\0" + claim_key).digest()
        self.samples = samples
        self.every = every
        self.shard_size = shard_size
        self.max_new_tokens = max_new_tokens
        self.pending: dict[str, _Pending] = {}

    def due(self, step: int, last_step: int) -> bool:
        """Evaluate the version of ``step``: the first, every ``every`` steps, and the last."""
        return step == 0 or step == last_step or (self.every > 0 and step % self.every == 0)

    def requested_earlier(self, version: int) -> bool:
        """Whether an earlier life of the controller requested an evaluation of ``version``: it was announced at
        a step whose evaluation was due (the only evaluations a controller requests)."""
        step = self.step_of(version)
        return step is not None and self.due(step, self.last_step)

    def claim(self, eval_id: str, shard: int) -> str:
        """The shard's claim token: an HMAC under the controller's key, so a restarted controller derives the same."""
        return hmac.new(self._claim_key, f"{eval_id}/{shard}".encode(), "sha256").hexdigest()[:32]

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
            await self._issue(eval_id, version, shard, chunks)
        log.info("eval_requested", eval_id=eval_id, version=version, shards=len(chunks), samples=len(self.samples))
        return eval_id

    async def _issue(
        self, eval_id: str, version: int, shard: int, chunks: list[list[Sample]], attempt: int = 0
    ) -> None:
        task = EvalTask(
            eval_id=eval_id,
            version=version,
            shard=shard,
            shards=len(chunks),
            samples=[
                {"sample_id": s.id, "prompt": s.prompt, "answer": s.answer, "meta": s.meta} for s in chunks[shard]
            ],
            max_new_tokens=self.max_new_tokens,
            claim=self.claim(eval_id, shard),
        )
        # The message id makes a re-sent shard (a controller restarted mid-issue) a no-op in the stream.
        suffix = f"-r{attempt}" if attempt else ""
        await self.bus.publish(self.bus.subjects.evalq, task, msg_id=f"{eval_id}-{shard}{suffix}")

    async def reissue(self, result: EvalShardResult) -> bool:
        """Issue again a shard whose result was refused though it carried the claim (whoever took the shard
        answered it with values that cannot be believed, so no one else will play it); False once the shard
        was issued again ``MAX_REISSUES`` times or no longer waits for a result."""
        pending = self.pending.get(result.eval_id)
        if pending is None or pending.done.is_set() or result.shard >= len(pending.sizes):
            return False
        if pending.has(result.shard) or result.claim != self.claim(result.eval_id, result.shard):
            return False
        attempt = pending.reissued.get(result.shard, 0) + 1
        if attempt > MAX_REISSUES:
            return False
        pending.reissued[result.shard] = attempt
        await self._issue(result.eval_id, pending.version, result.shard, self._chunks(), attempt)
        log.warning("eval_shard_reissued", eval_id=result.eval_id, shard=result.shard, attempt=attempt)
        return True

    def refusal(self, result: EvalShardResult) -> str | None:
        """Why ``result`` cannot be counted (None: it can): an evaluation never requested, a shard out of range
        or counted already, a claim that is not the shard's, another sample count than the shard's, a version
        older than requested, a reward sum that is not finite or outside what the task's rewards can add up to."""
        pending = self.pending.get(result.eval_id)
        if pending is None and result.eval_id[1:].isdigit() and self.requested_earlier(int(result.eval_id[1:])):
            pending = self._restored(result.eval_id, int(result.eval_id[1:]))
        if pending is None:
            return f"eval {result.eval_id!r} was never requested"
        if result.shard >= len(pending.sizes) or pending.has(result.shard):
            return f"shard {result.shard} of {result.eval_id} is out of range or counted already"
        if not hmac.compare_digest(result.claim, self.claim(result.eval_id, result.shard)):
            return f"shard {result.shard} of {result.eval_id}: not the shard's claim (its sender did not take it)"
        if result.samples != pending.sizes[result.shard] or result.failed > result.samples:
            expected = pending.sizes[result.shard]
            return f"shard {result.shard} of {result.eval_id} has {expected} samples, not {result.samples}"
        if result.version < pending.version:
            return f"{result.eval_id} evaluated at version {result.version}, older than requested"
        if not math.isfinite(result.reward_sum):
            return "reward_sum is not finite"
        if self.reward_range is not None:
            scored = result.samples - result.failed  # a failed sample counts 0
            low, high = (bound * scored for bound in self.reward_range)
            slack = 1e-9 * max(1, scored) * max(1.0, *(abs(b) for b in self.reward_range))  # float summation
            if not low - slack <= result.reward_sum <= high + slack:
                return (
                    f"reward_sum {result.reward_sum} of {scored} scored samples is outside what task.reward_range "
                    f"{list(self.reward_range)} allows ([{low:g}, {high:g}])"
                )
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

    def parts(self) -> list[EvaluationPart]:
        """Every evaluation known, as parts of the controller's snapshot."""
        return [pending.part(eval_id) for eval_id, pending in self.pending.items()]

    def restore(self, parts: list[EvaluationPart]) -> None:
        """Take the evaluations of a snapshot (none is marked requested: a restart requests those due again)."""
        self.pending = {part.eval_id: _Pending.from_part(part) for part in parts}

    def open_versions(self) -> list[int]:
        """Versions of the evaluations known and not complete."""
        return [p.version for p in self.pending.values() if not p.done.is_set()]

    def stats(self) -> dict[str, Any]:
        return {"evals_pending": float(sum(not p.done.is_set() for p in self.pending.values()))}
