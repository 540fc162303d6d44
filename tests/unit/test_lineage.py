"""The trainer's bounded memory: resolved group indexes, version lineage across restarts, recovery plans."""

from __future__ import annotations

import pytest

from miles.bus.schema import WeightsAnnounced
from miles.training.lineage import IndexSet, VersionLineage
from miles.training.recovery import TrainerHistory, plan_recovery


def test_index_set_is_exact_and_compact() -> None:
    s = IndexSet()
    for i in [0, 1, 3, 2, 7, 5, 4]:
        s.add(i)
    assert s.floor == 6 and s.above == {7}
    assert all(i in s for i in [0, 1, 2, 3, 4, 5, 7]) and 6 not in s and 8 not in s
    assert len(s) == 7
    assert IndexSet.from_json(s.to_json()) == s
    s.add(2)  # already below the floor: nothing changes
    assert s.floor == 6


def test_distance_on_the_lineage_and_on_a_dead_branch() -> None:
    lineage = VersionLineage(alive={0: 0})
    for v in range(1, 6):
        lineage.advance(v, v)
    assert lineage.distance(5) == 0 and lineage.distance(2) == 3 and lineage.distance(99) is None
    # restart from the checkpoint at step 3: versions 4 and 5 are lost
    lineage = VersionLineage(alive={0: 0, 1: 1, 2: 2, 3: 3})
    lineage.supersede({4: 4, 5: 5}, fork_step=3)
    lineage.advance(6, 3)  # the restored weights, republished
    lineage.advance(7, 4)  # the replay of step 4
    assert lineage.step == 4 and lineage.version == 7
    assert lineage.distance(7) == 0 and lineage.distance(6) == 1 and lineage.distance(3) == 1
    assert lineage.distance(5) == (5 - 3) + (4 - 3)  # back to the fork, then forward
    assert lineage.distance(4) == 2
    with pytest.raises(ValueError, match="never reused"):
        lineage.advance(7, 5)
    assert VersionLineage.from_json(lineage.to_json()).distance(5) == 3


def test_old_versions_are_forgotten() -> None:
    lineage = VersionLineage(alive={0: 0}, keep_steps=3)
    for v in range(1, 10):
        lineage.advance(v, v)
    assert lineage.distance(9) == 0 and lineage.distance(6) == 3 and lineage.distance(2) is None


def _ann(version: int, step: int, consumed: list[int]) -> WeightsAnnounced:
    return WeightsAnnounced(version=version, step=step, consumed=consumed, digest="d", size=1, chunks=1)


def test_recovery_replays_each_lost_step_once_in_order() -> None:
    history = TrainerHistory(
        announcements=[
            (10, _ann(4, 4, [40, 41])),
            (11, _ann(5, 5, [50, 51])),
            (12, _ann(6, 6, [60])),
            # a first restart (from step 3) published the restored weights and replayed step 4, then died
            (13, _ann(7, 3, [])),
            (14, _ann(8, 4, [40, 41])),
        ]
    )
    plan = plan_recovery(checkpoint_version=3, checkpoint_step=3, history=history)
    assert plan.lost == {4: 4, 5: 5, 6: 6, 7: 3, 8: 4}
    assert [(a.version, a.step, a.consumed) for a in plan.replay] == [(8, 4, [40, 41]), (5, 5, [50, 51]), (6, 6, [60])]
    assert history.max_version == 8


def test_nothing_to_replay_after_a_clean_checkpoint() -> None:
    plan = plan_recovery(3, 3, TrainerHistory())
    assert plan.lost == {} and plan.replay == []


def test_every_version_map_keeps_four_staleness_windows_and_at_least_the_minimum() -> None:
    from miles.training.lineage import MIN_VERSIONS_KEPT, VersionSteps, versions_kept

    assert versions_kept(0) == versions_kept(2) == MIN_VERSIONS_KEPT
    assert versions_kept(99) == 400  # a bound that large keeps four windows of it
    versions = VersionSteps(keep=3)
    versions.restore([(1, 0), (2, 1), (3, 2), (4, 3)])  # a snapshot's pairs: the newest three are kept
    assert sorted(versions.items()) == [(2, 1), (3, 2), (4, 3)] and 1 not in versions
    assert versions.get(4) == versions[4] == versions.step_of(4) == 3 and versions.get(9) is None
