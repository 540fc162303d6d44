"""Trust rules: what an actor refuses even when a message is well formed and (where signed) signed.

Permissions decide who may publish on a subject and signatures who wrote a message; these rules decide
whether its *content* can be believed, from what the actor already knows: versions the trainer
announced and the data plane holds, groups the controller issued, steps already recorded, the workers
that are alive. Each rule is a pure function returning the reason to refuse (one line) or None; the actor
refuses through :meth:`miles.bus.client.Bus.refuse` (dead letter with the reason, counted) and never acts
on the message. docs/security.md lists every rule with the forgery it stops.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping

from miles.bus.schema import (
    GroupsDiscarded,
    Heartbeat,
    PromptGroup,
    StepMetrics,
    TrainerDone,
    Trajectory,
    WeightsAnnounced,
    WeightsHeld,
)

# How far a new version may jump ahead of the newest one seen. Versions are unique ids the trainer
# numbers max + 1 (a restart too), and announcements are read in stream order, so a real jump is 1; the
# slack covers announcements purged before a restarted reader looked.
MAX_VERSION_JUMP = 64
ROLES = ("controller", "rollout", "trainer", "monitor", "teacher")


def announcement_refusal(
    ann: WeightsAnnounced, *, newest: int, max_steps: int, stored: tuple[str, int] | None | bool
) -> str | None:
    """An announcement of a new version (``ann.version > newest``) the controller may not believe.

    ``stored`` is the data plane's ``(digest, size)`` of the version for the bus transport, None when it
    holds no such version, or True where nothing can be looked up (another transport)."""
    if newest >= 0 and ann.version > newest + MAX_VERSION_JUMP:
        return f"version {ann.version} jumps more than {MAX_VERSION_JUMP} past the newest announced ({newest})"
    if ann.step > max_steps:
        return f"step {ann.step} is past the run's last step ({max_steps})"
    if stored is None:
        return f"version {ann.version} is not in the data plane"
    if stored is not True and stored != (ann.digest, ann.size):
        return f"version {ann.version} in the data plane has another digest or size than announced"
    return None


def discard_refusal(msg: GroupsDiscarded, *, issued: int, resolved: Container[int]) -> str | None:
    """A discard naming a group that was never issued, or one already trained or discarded."""
    for gid in msg.group_ids:
        index = int(gid[1:])
        if index >= issued:
            return f"group {gid} was never issued ({issued} so far)"
        if index in resolved:
            return f"group {gid} was already trained or discarded"
    if len(set(msg.group_ids)) != len(msg.group_ids):
        return "a group is named twice"
    return None


def step_refusal(msg: StepMetrics, *, version_steps: Mapping[int, int], recorded: Container[int]) -> str | None:
    """Step metrics for a version never announced, or whose announcement is of another step."""
    step = version_steps.get(msg.policy_version)
    if step is None:
        return f"version {msg.policy_version} was never announced"
    if step != msg.step + 1:
        return f"step {msg.step} does not match version {msg.policy_version} (announced at step {step})"
    if msg.step in recorded and not msg.replayed:
        return f"step {msg.step} is recorded already"
    return None


def done_refusal(msg: TrainerDone, *, version_steps: Mapping[int, int], steps: int) -> str | None:
    """A ``trainer_done`` before the last step, or for a version that is not the last step's."""
    if msg.steps != steps:
        return f"trainer_done after {msg.steps} steps, the run has {steps}"
    if version_steps.get(msg.policy_version) != steps:
        return f"version {msg.policy_version} is not an announced version of step {steps}"
    return None


def heartbeat_refusal(hb: Heartbeat, subject: str, *, run: str, newest: int) -> str | None:
    """A heartbeat whose body disagrees with its subject (``<run>.hb.<role>.<actor_id>``) or is out of range."""
    if subject != f"{run}.hb.{hb.role}.{hb.actor_id}":
        return f"heartbeat of {hb.role}/{hb.actor_id} on subject {subject}"
    if hb.role not in ROLES:
        return f"unknown role {hb.role!r}"
    if hb.version > max(newest, 0) + MAX_VERSION_JUMP:
        return f"version {hb.version} was never announced"
    counts = {k: v for k, v in hb.stats.items() if k == "dead_lettered" or k.startswith("refused_")}
    if not all(math.isfinite(v) and 0 <= v < 2**53 for v in counts.values()):
        return "refusal counts that are not non-negative numbers"
    return None


def held_refusal(held: WeightsHeld, *, workers: Container[str], newest: int) -> str | None:
    """A held-weight report from no live rollout worker, or for a version never announced."""
    if held.worker_id not in workers:
        return f"{held.worker_id!r} is not a live rollout worker"
    if held.version < 0 or held.version > max(newest, 0) + MAX_VERSION_JUMP:  # a report may overtake its announcement
        return f"version {held.version} was never announced"
    return None


def trajectory_refusal(
    traj: Trajectory,
    ticket: PromptGroup | None,
    *,
    vocab_size: int,
    issued: int | None,
    newest: int,
    reward_range: tuple[float, float] | None = None,
) -> str | None:
    """A trajectory the trainer must not train on: :func:`content_refusal`, then :func:`standing_refusal`.

    ``ticket`` is the prompt group it answers, as the controller issued it (verified by the caller when
    signatures are on); ``issued`` the controller's count of issued groups, None if unknown; ``newest`` the
    newest version the trainer published (a trajectory claiming a later one was not generated by this run);
    ``reward_range`` the task's (``task.reward_range``): a scored episode outside it was not scored by the task."""
    return content_refusal(traj, ticket, vocab_size=vocab_size, reward_range=reward_range) or standing_refusal(
        traj, issued=issued, newest=newest
    )


def content_refusal(
    traj: Trajectory, ticket: PromptGroup | None, *, vocab_size: int, reward_range: tuple[float, float] | None = None
) -> str | None:
    """What is wrong with the trajectory itself, whatever the run's state: its ticket, its size, its token ids
    and rewards. Pure, so the trainer checks a batch on a thread while the previous one trains."""
    if ticket is not None and (ticket.group_id, ticket.sample_id) != (traj.group_id, traj.sample_id):
        return f"trajectory {traj.group_id}/{traj.sample_id} carries the ticket of {ticket.group_id}/{ticket.sample_id}"
    if ticket is not None and len(traj.episodes) > ticket.group_size:
        return f"{len(traj.episodes)} episodes for a group of {ticket.group_size}"
    for i, ep in enumerate(traj.episodes):
        for ids in (ep.prompt_ids, ep.token_ids):
            if ids and not (0 <= min(ids) and max(ids) < vocab_size):  # min/max: ~5x a per-token test
                bad = next(t for t in ids if not 0 <= t < vocab_size)
                return f"episode {i}: token id {bad} outside the vocabulary ({vocab_size})"
        if reward_range is not None and ep.reward is not None and not reward_range[0] <= ep.reward <= reward_range[1]:
            return f"episode {i}: reward {ep.reward} outside task.reward_range {list(reward_range)}"
    return None


def standing_refusal(traj: Trajectory, *, issued: int | None, newest: int) -> str | None:
    """What the run's state says against the trajectory: a group never issued, a version never published."""
    if issued is not None and traj.issue_index >= issued:
        return f"group {traj.group_id} was never issued ({issued} so far)"
    for i, ep in enumerate(traj.episodes):
        unknown = [v for _, v in ep.spans if v > newest]
        if unknown:
            return f"episode {i}: generated with version {unknown[0]}, which this trainer never published"
    return None
