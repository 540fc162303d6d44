"""The reward audit: the trainer re-scores a random share of trajectories with the task's own reward.

Rollout workers score their own episodes, and every worker holds the same rollout identity, so nothing but
the values themselves says whether a worker scored honestly. The range check (``task.reward_range``) stops
absurd values; this audit stops plausible lies: with ``trainer.audit.rate`` r, each trajectory is re-scored
with probability r, drawn from the operating system's randomness (a worker cannot predict which ones). A
trajectory whose rewards disagree with the task's by more than ``tolerance`` is refused; after
``exclude_after`` of them its worker (the ``worker_id`` it claims) is no longer believed: its trajectories are
refused unseen and re-issued to others. A worker that lies on n trajectories is caught with probability
``1 - (1 - r) ** n`` (docs/security.md).

Re-scoring covers single-turn text tasks (a ``reward(completion, sample)`` on the model's one turn, decoded as
the worker decoded it); an agent's reward comes from a sandbox the trainer does not replay.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from miles.bus.schema import Episode, PromptGroup, Trajectory
from miles.tasks.base import Sample, TextTask

log = structlog.get_logger(__name__)

Decode = Callable[[Sequence[int]], str]
# The trainer's heartbeat counts of the audit (summary.json ``reward_audit`` drops the ``audit_`` prefix).
REWARD_AUDIT_KEYS = ("audited", "audit_mismatches", "audit_excluded_workers", "audit_refused_excluded")


def completion_text(episode: Episode, decode: Decode) -> str:
    """The text a single-turn episode's reward was computed on: its model turn, decoded as the worker did
    (special tokens removed); '' when the turn was cut by the context window (the environment never saw it)."""
    if episode.end_reason == "context_full":
        return ""
    turns = [(start, end) for start, end, who in episode.turns if who == "model"]
    if not turns:
        return ""
    start, end = turns[0]
    return decode(episode.token_ids[start:end])


@dataclass(slots=True)
class RewardAudit:
    """Which trajectories to re-score, the verdicts, and the workers no longer believed."""

    task: TextTask
    decode: Decode
    rate: float
    tolerance: float = 1e-6
    exclude_after: int = 1
    draw: Callable[[], float] = field(default_factory=lambda: random.SystemRandom().random)
    excluded: set[str] = field(default_factory=set)
    mismatches: Counter[str] = field(default_factory=Counter)  # worker -> trajectories whose rewards disagreed
    audited: int = 0
    refused_excluded: int = 0  # trajectories refused unseen because their worker was excluded

    def disagreement(self, traj: Trajectory, ticket: PromptGroup) -> str | None:
        """Re-score every scored episode of ``traj`` (blocking: the task's reward may be slow): why its rewards
        are not the task's, or None."""
        sample = Sample(id=ticket.sample_id, prompt=ticket.prompt, answer=ticket.answer, meta=dict(ticket.meta))
        for i, episode in enumerate(traj.episodes):
            if episode.reward is None:
                continue
            try:
                expected = float(self.task.reward(completion_text(episode, self.decode), sample))
            except Exception as exc:  # a user's reward may raise anything; on an honest worker it failed too
                why = f"{type(exc).__name__}: {exc}"[:300]
                return f"episode {i}: reward {episode.reward}, the task's reward raised {why} (reward_failed)"
            if not math.isfinite(expected) or abs(expected - episode.reward) > self.tolerance:
                return f"episode {i}: reward {episode.reward}, the task gives {expected}"
        return None

    async def refusal(self, traj: Trajectory, ticket: PromptGroup | None) -> str | None:
        """Why the trainer must not believe ``traj`` (its worker is excluded, or a re-score disagreed), or None."""
        worker = traj.worker_id
        if worker in self.excluded:
            self.refused_excluded += 1
            return f"worker {worker!r} was excluded by the reward audit"
        if ticket is None or self.rate <= 0 or self.draw() >= self.rate:
            return None
        self.audited += 1
        why = await asyncio.to_thread(self.disagreement, traj, ticket)
        if why is None:
            return None
        self.mismatches[worker] += 1
        if self.mismatches[worker] >= self.exclude_after and worker not in self.excluded:
            self.excluded.add(worker)
            log.error("audit_worker_excluded", worker=worker, mismatches=self.mismatches[worker], last=why)
        return f"reward audit: {why}"

    def stats(self) -> dict[str, float]:
        counts = (self.audited, sum(self.mismatches.values()), len(self.excluded), self.refused_excluded)
        return {key: float(n) for key, n in zip(REWARD_AUDIT_KEYS, counts, strict=True)}


def reward_audit_alarm(trainer_stats: Mapping[str, float]) -> str | None:
    """The alarm line for summary.json and ``miles top`` from the trainer's heartbeat, or None if all agreed."""
    mismatches = int(trainer_stats.get("audit_mismatches", 0))
    if not mismatches:
        return None
    excluded = int(trainer_stats.get("audit_excluded_workers", 0))
    return (
        f"the reward audit found {mismatches} trajectories whose rewards the task does not give; "
        f"{excluded} workers no longer believed"
    )
