"""The trajectory audit: the trainer checks a random share of what untrusted rollout workers report.

Rollout workers score their own episodes and report their own behaviour log-probs, and every worker holds the
same rollout identity, so nothing but the values themselves says whether a worker reported honestly. The range
check (``task.reward_range``) stops absurd values; this audit stops plausible lies. Two checks, each on a share
of trajectories drawn from the operating system's randomness (a worker cannot predict which ones):

* rewards (``trainer.audit.rate``): re-scored with the task's own reward, on the model turn decoded as the
  worker decodes it; they must agree within ``tolerance``. Single-turn text tasks: an agent's reward comes from
  a sandbox the trainer does not replay.
* behaviour log-probs (``trainer.audit.logprob_rate``): re-computed by the trainer's own forward under the
  weights that sampled them (it keeps the versions within the staleness bound,
  :mod:`miles.training.snapshots`); their mean absolute difference must stay within ``logprob_tolerance``
  (nats per token). Any task, agents included.

After ``exclude_after`` disagreeing trajectories a worker (the ``worker_id`` it claims) is no longer believed:
its trajectories are refused unseen and re-issued to others. A worker that lies on n checked-eligible
trajectories is caught with probability ``1 - (1 - r) ** n`` (docs/security.md).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from miles.backends.base import TrainSample
from miles.bus.schema import Episode, PromptGroup, Trajectory
from miles.tasks.base import Sample, TextTask

log = structlog.get_logger(__name__)

Decode = Callable[[Sequence[int]], str]
# The trainer's heartbeat counts of the audit (summary.json ``audit`` drops the ``audit_`` prefix).
AUDIT_KEYS = (
    "audited",
    "audit_mismatches",
    "audit_excluded_workers",
    "audit_refused_excluded",
    "audit_logprobs_checked",
    "audit_logprob_mismatches",
)
# Where the trainer scores with exactly the weights workers hold, honest gaps are float rounding (1.5e-5 at most
# in a quickstart run, docs/security.md): a forgery that moves anything is far above.
DEFAULT_LOGPROB_TOLERANCE = 0.05
GAP_MAX_KEY = "audit_logprob_gap_max"  # the largest gap the log-prob audit accepted (to set the tolerance by)


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


def logprob_samples(traj: Trajectory, versions: Container[int]) -> list[TrainSample]:
    """The trained episodes of ``traj`` sampled entirely under one of ``versions`` (those whose weights the
    trainer holds), as samples of that ``weight_version``. An episode whose weights changed while it was
    generated is left out: the engine kept the cache of its earlier tokens, computed under the older weights,
    so its later log-probs are not those of either version alone (an honest one differed by 0.064 nats per
    token in a quickstart run, against at most 0.013 for whole episodes)."""
    return [
        TrainSample(
            prompt_ids=list(episode.prompt_ids),
            token_ids=list(episode.token_ids),
            loss_mask=list(episode.loss_mask),
            behaviour_logprobs=list(episode.logprobs),
            weight_version=episode.weight_version,
        )
        for episode in traj.trained_episodes
        if episode.oldest_version == episode.newest_version and episode.weight_version in versions
    ]


@dataclass(slots=True)
class RewardCheck:
    """The task's own reward and the tokenizer's decoding, as a worker runs them."""

    task: TextTask
    decode: Decode

    def disagreement(self, traj: Trajectory, ticket: PromptGroup, tolerance: float) -> str | None:
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
            if not math.isfinite(expected) or abs(expected - episode.reward) > tolerance:
                return f"episode {i}: reward {episode.reward}, the task gives {expected}"
        return None


@dataclass(slots=True)
class TrajectoryAudit:
    """Which trajectories to check, the verdicts, and the workers no longer believed."""

    rewards: RewardCheck | None = None  # None: rewards are not re-scored
    rate: float = 0.0
    tolerance: float = 1e-6
    logprob_rate: float = 0.0
    logprob_tolerance: float = DEFAULT_LOGPROB_TOLERANCE
    exclude_after: int = 1
    draw: Callable[[], float] = field(default_factory=lambda: random.SystemRandom().random)
    excluded: set[str] = field(default_factory=set)
    mismatches: Counter[str] = field(default_factory=Counter)  # worker -> trajectories that disagreed
    audited: int = 0  # trajectories whose rewards were re-scored
    logprobs_checked: int = 0
    logprob_mismatches: int = 0
    logprob_gap_max: float = 0.0  # of the trajectories that passed
    refused_excluded: int = 0  # trajectories refused unseen because their worker was excluded

    def _disagreed(self, worker: str, why: str) -> str:
        self.mismatches[worker] += 1
        if self.mismatches[worker] >= self.exclude_after and worker not in self.excluded:
            self.excluded.add(worker)
            log.error("audit_worker_excluded", worker=worker, mismatches=self.mismatches[worker], last=why)
        return why

    async def refusal(self, traj: Trajectory, ticket: PromptGroup | None) -> str | None:
        """Why the trainer must not believe ``traj`` (its worker is excluded, or a reward re-score disagreed),
        or None."""
        worker = traj.worker_id
        if worker in self.excluded:
            self.refused_excluded += 1
            return f"worker {worker!r} was excluded by the audit"
        if self.rewards is None or ticket is None or self.rate <= 0 or self.draw() >= self.rate:
            return None
        self.audited += 1
        why = await asyncio.to_thread(self.rewards.disagreement, traj, ticket, self.tolerance)
        return None if why is None else self._disagreed(worker, f"reward audit: {why}")

    def draw_logprobs(self) -> bool:
        """Whether to re-compute the log-probs of the next trajectory held (that has tokens to check)."""
        return self.logprob_rate > 0 and self.draw() < self.logprob_rate

    def judge_logprobs(self, traj: Trajectory, abs_diff_sum: float, tokens: float) -> str | None:
        """The verdict on a trajectory whose ``tokens`` checked log-probs differ from the trainer's by
        ``abs_diff_sum`` in all (nats): why it is refused, or None."""
        self.logprobs_checked += 1
        gap = abs_diff_sum / max(tokens, 1.0)
        if math.isfinite(gap) and gap <= self.logprob_tolerance:
            self.logprob_gap_max = max(self.logprob_gap_max, gap)
            return None
        self.logprob_mismatches += 1
        why = (
            f"log-prob audit: behaviour log-probs differ from the trainer's by {gap:.4g} nats per token "
            f"on {int(tokens)} tokens (tolerance {self.logprob_tolerance})"
        )
        return self._disagreed(traj.worker_id, why)

    def stats(self) -> dict[str, float]:
        counts = (
            self.audited,
            sum(self.mismatches.values()),
            len(self.excluded),
            self.refused_excluded,
            self.logprobs_checked,
            self.logprob_mismatches,
        )
        return {key: float(n) for key, n in zip(AUDIT_KEYS, counts, strict=True)} | {GAP_MAX_KEY: self.logprob_gap_max}


def audit_alarm(trainer_stats: Mapping[str, float]) -> str | None:
    """The alarm line for summary.json and ``miles top`` from the trainer's heartbeat, or None if all agreed."""
    mismatches = int(trainer_stats.get("audit_mismatches", 0))
    if not mismatches:
        return None
    logprobs = int(trainer_stats.get("audit_logprob_mismatches", 0))
    excluded = int(trainer_stats.get("audit_excluded_workers", 0))
    return (
        f"the audit found {mismatches} trajectories that disagree with the trainer ({mismatches - logprobs} on "
        f"rewards, {logprobs} on log-probs); {excluded} workers no longer believed"
    )
