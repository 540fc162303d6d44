"""Group filters: which prompt groups are trained (DAPO's dynamic sampling), and what filtering costs in credits.

A filter sees the rewards of a group's trainable episodes (after reward shaping, exactly what the advantage
estimator will see) and says whether the group is trained. DAPO keeps only groups whose rewards differ: a
group of equal rewards has advantage 0 under GRPO, so it costs compute and dilutes the batch without moving
the policy.

Filtering crosses actors. The trainer leader applies the filter when it collects trajectories and reports a
filtered group to the controller exactly like a discard (``groups_discarded``, reason ``filtered``, not
re-queued): its admission credit comes back, so the controller issues a new prompt in its place, and the
ledger records it as ``filtered``. Every step therefore still trains ``groups_per_step`` groups. With
``over_issue`` the controller also keeps that fraction of a batch in flight on top of the staleness window,
so replacements are already being played when a group is filtered (:func:`over_issue_groups`).

Torch-free: the controller imports it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from miles.plugins import Registry


class GroupFilter(Protocol):
    """Rewards of a group's trainable episodes -> True to train the group, False to filter it out."""

    def __call__(self, rewards: Sequence[float]) -> bool: ...


GROUP_FILTERS: Registry[GroupFilter] = Registry("group filter")


def reward_std(rewards: Sequence[float]) -> float:
    """Population standard deviation (0 for fewer than two rewards)."""
    if len(rewards) < 2:
        return 0.0
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


def has_reward_variance(rewards: Sequence[float], min_std: float = 0.0) -> bool:
    """DAPO's dynamic-sampling test: the group's rewards are not all equal (std > ``min_std``).

    ``min_std == 0`` compares exactly (``max > min``), so no rounding residue keeps a group of equal rewards."""
    if len(rewards) < 2:
        return False
    if min_std == 0.0:
        return max(rewards) > min(rewards)
    return reward_std(rewards) > min_std


@GROUP_FILTERS.register("none")
def _none(cfg: Any) -> GroupFilter:
    return lambda rewards: True


@GROUP_FILTERS.register("reward_variance")
def _reward_variance(cfg: Any) -> GroupFilter:
    min_std = float(cfg.min_std)
    return lambda rewards: has_reward_variance(rewards, min_std)


def build_group_filter(cfg: Any) -> GroupFilter | None:
    """The filter of a ``trainer.algo.filter`` section; None for ``none`` (nothing to check)."""
    return None if cfg.type == "none" else GROUP_FILTERS.build(cfg)


def over_issue_groups(algo: Any, groups_per_step: int) -> int:
    """Groups the controller admits on top of the staleness window for a filter's replacements:
    ``ceil(over_issue * groups_per_step)``, 0 without a filter that asks for it."""
    fraction = float(getattr(algo.filter, "over_issue", 0.0) or 0.0)
    return math.ceil(fraction * groups_per_step)
