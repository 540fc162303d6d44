"""A rollout worker holds new groups while an evaluation pins weights that a newer version has overtaken."""

from __future__ import annotations

import pytest

from miles.actors.rollout import holds_for_evaluation


@pytest.mark.parametrize(
    ("evaluating", "engine_version", "newest_announced", "held"),
    [
        (True, 4, 5, True),  # pinned at 4 while 5 is out: a group started now would be played on 4
        (True, 4, 9, True),
        (True, 5, 5, False),  # the pinned weights are the newest: the group is as fresh as it can be
        (True, -1, -1, False),  # nothing announced yet
        (False, 4, 9, False),  # not pinned: the engine switches at its next token boundary, never wait
    ],
)
def test_a_group_waits_only_for_pinned_weights_that_are_behind(
    evaluating: bool, engine_version: int, newest_announced: int, held: bool
) -> None:
    assert (
        holds_for_evaluation(evaluating=evaluating, engine_version=engine_version, newest_announced=newest_announced)
        is held
    )
