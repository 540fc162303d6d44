"""The trust rules: each refuses exactly the forgery it names and lets the real message through."""

from __future__ import annotations

from miles.actors import trust
from miles.bus.schema import (
    Episode,
    GroupsDiscarded,
    Heartbeat,
    PromptGroup,
    StepMetrics,
    TrainerDone,
    Trajectory,
    WeightsAnnounced,
    WeightsHeld,
)
from miles.training.lineage import IndexSet


def ann(version: int, step: int = 1, **kw: object) -> WeightsAnnounced:
    return WeightsAnnounced(version=version, step=step, digest="d", size=10, chunks=1, **kw)  # type: ignore[arg-type]


def test_an_announcement_is_believed_only_if_the_data_plane_holds_it() -> None:
    assert trust.announcement_refusal(ann(4), newest=3, max_steps=10, stored=("d", 10)) is None
    assert "not in the data plane" in trust.announcement_refusal(ann(4), newest=3, max_steps=10, stored=None)
    assert "another digest" in trust.announcement_refusal(ann(4), newest=3, max_steps=10, stored=("x", 10))
    assert trust.announcement_refusal(ann(4, transport="fs"), newest=3, max_steps=10, stored=True) is None
    # the audit's forgeries: a version far ahead (prompts no worker could serve), a step past the run
    assert "jumps" in trust.announcement_refusal(ann(2**53 - 1), newest=3, max_steps=10, stored=True)
    assert "past the run" in trust.announcement_refusal(ann(4, step=11), newest=3, max_steps=10, stored=True)


def test_discards_name_only_issued_unresolved_groups() -> None:
    resolved = IndexSet()
    resolved.add(0)
    ok = GroupsDiscarded(group_ids=["g1"], sample_ids=["a"], requeue=True, trainer_version=1)
    assert trust.discard_refusal(ok, issued=2, resolved=resolved) is None
    never = GroupsDiscarded(group_ids=["g900000"], sample_ids=["a"], requeue=False, trainer_version=1)
    assert "never issued" in trust.discard_refusal(never, issued=2, resolved=resolved)
    again = GroupsDiscarded(group_ids=["g0"], sample_ids=["a"], requeue=False, trainer_version=1)
    assert "already" in trust.discard_refusal(again, issued=2, resolved=resolved)
    twice = GroupsDiscarded(group_ids=["g1", "g1"], sample_ids=["a", "a"], requeue=False, trainer_version=1)
    assert "twice" in trust.discard_refusal(twice, issued=2, resolved=resolved)


def test_step_metrics_and_done_must_match_announced_versions() -> None:
    steps = {5: 3}  # version 5 was announced at lineage step 3 (it trained step index 2)
    real = StepMetrics(step=2, policy_version=5, metrics={}, trained_group_ids=[], staleness=[])
    assert trust.step_refusal(real, version_steps=steps, recorded=set()) is None
    assert "recorded already" in trust.step_refusal(real, version_steps=steps, recorded={2})
    forged = StepMetrics(
        step=9999, policy_version=5, metrics={"reward_mean": 1234.5}, trained_group_ids=[], staleness=[]
    )
    assert "does not match" in trust.step_refusal(forged, version_steps=steps, recorded=set())
    unknown = StepMetrics(step=2, policy_version=77, metrics={}, trained_group_ids=[], staleness=[])
    assert "never announced" in trust.step_refusal(unknown, version_steps=steps, recorded=set())
    assert trust.done_refusal(TrainerDone(policy_version=5, steps=3), version_steps=steps, steps=3) is None
    assert "the run has 150" in trust.done_refusal(
        TrainerDone(policy_version=5, steps=72), version_steps=steps, steps=150
    )
    assert "not an announced" in trust.done_refusal(
        TrainerDone(policy_version=6, steps=3), version_steps=steps, steps=3
    )


def test_heartbeats_and_held_reports_are_checked_against_what_is_known() -> None:
    hb = Heartbeat(role="rollout", actor_id="rollout-0", version=3, stats={"dead_lettered": 1.0})
    assert trust.heartbeat_refusal(hb, "r.hb.rollout.rollout-0", run="r", newest=3) is None
    assert "on subject" in trust.heartbeat_refusal(hb, "r.hb.trainer.rollout-0", run="r", newest=3)
    huge = Heartbeat(role="rollout", actor_id="rollout-0", version=2**53 - 1)
    assert "never announced" in trust.heartbeat_refusal(huge, "r.hb.rollout.rollout-0", run="r", newest=3)
    inflated = Heartbeat(role="rollout", actor_id="rollout-0", stats={"refused_unsigned": -5.0})
    assert "refusal counts" in trust.heartbeat_refusal(inflated, "r.hb.rollout.rollout-0", run="r", newest=3)
    held = WeightsHeld(worker_id="rollout-0", version=3, state_digest="x", mode="full")
    assert trust.held_refusal(held, workers={"rollout-0"}, newest=3) is None
    assert "not a live" in trust.held_refusal(held, workers={"rollout-1"}, newest=3)


def _traj(group: str, tokens: list[int], version: int = 0, reward: float = 1.0) -> Trajectory:
    episode = Episode(
        prompt_ids=[1],
        token_ids=tokens,
        loss_mask=[1] * len(tokens),
        logprobs=[-0.1] * len(tokens),
        turns=[(0, len(tokens), "model")],
        weight_version=version,
        reward=reward,
        status="ok",
        end_reason="done",
    )
    return Trajectory(group_id=group, sample_id="s", worker_id="w", episodes=[episode], issued_at_version=0, gen_s=0.0)


def test_trajectories_must_answer_an_issued_group_with_real_tokens_and_versions() -> None:
    ticket = PromptGroup(
        group_id="g3", sample_id="s", prompt="p", answer="a", group_size=4, issue_index=3, issued_at_version=0
    )
    kw = dict(vocab_size=100, issued=10, newest=5)
    assert trust.trajectory_refusal(_traj("g3", [5, 6]), ticket, **kw) is None  # type: ignore[arg-type]
    assert "never issued" in trust.trajectory_refusal(_traj("g999", [5]), None, **kw)  # type: ignore[arg-type]
    assert "ticket of g3" in trust.trajectory_refusal(_traj("g4", [5]), ticket, **kw)  # type: ignore[arg-type]
    assert "vocabulary" in trust.trajectory_refusal(_traj("g3", [5, 100]), ticket, **kw)  # type: ignore[arg-type]
    assert "never published" in trust.trajectory_refusal(_traj("g3", [5], version=9), ticket, **kw)  # type: ignore[arg-type]


def test_a_reward_outside_the_tasks_range_is_refused() -> None:
    """A 0/1 task cannot produce 1000: a worker that says so is not believed (a user's reward without a declared
    range is only checked to be finite, by the schema)."""
    kw = dict(vocab_size=100, issued=10, newest=5)
    inflated = _traj("g3", [5], reward=1000.0)
    why = trust.trajectory_refusal(inflated, None, reward_range=(0.0, 1.0), **kw)  # type: ignore[arg-type]
    assert why is not None and "reward 1000.0 outside task.reward_range [0.0, 1.0]" in why
    assert "outside" in trust.trajectory_refusal(_traj("g3", [5], reward=-0.5), None, reward_range=(0.0, 1.0), **kw)  # type: ignore[arg-type,operator]
    assert trust.trajectory_refusal(_traj("g3", [5], reward=1.0), None, reward_range=(0.0, 1.0), **kw) is None  # type: ignore[arg-type]
    assert trust.trajectory_refusal(inflated, None, reward_range=None, **kw) is None  # type: ignore[arg-type]
