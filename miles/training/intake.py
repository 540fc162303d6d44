"""The trainer's verdict on one delivered trajectory, as a pure function.

:meth:`miles.actors.trainer.TrainerLeader._collect` acts on the verdict (ack, discard with or without re-queue,
hold for the batch); keeping the decision here lets the fleet simulator (:mod:`miles.sim.fleet`) drive the
very rule the trainer runs, instead of a copy of it that could drift.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Literal

Verdict = Literal["duplicate", "stale", "no_signal", "filtered", "accept"]
StalePrefix = Literal["discard", "mask"]


def classify(
    index: int,
    *,
    resolved: Container[int],
    held: Container[int],
    lag: int | None,
    max_staleness: int,
    has_trained_episodes: bool,
    keep: Callable[[], bool] | None = None,
) -> Verdict:
    """What to do with the trajectory of issue ``index``, checked in the trainer's order.

    ``lag`` is the lineage distance of its oldest version (None: unknown, so too old); ``keep`` is the group
    filter's verdict, called only when every earlier check passed (computing rewards is not free).
    """
    if index in resolved or index in held:
        return "duplicate"  # trained, discarded or already in this batch
    if lag is None or lag > max_staleness:
        return "stale"
    if not has_trained_episodes:
        return "no_signal"  # every episode failed: nothing to learn from this group
    if keep is not None and not keep():
        return "filtered"
    return "accept"


def judged_version(oldest: int, newest: int, stale_prefix: StalePrefix) -> int:
    """The version a trajectory's staleness is checked at: its oldest token's, or with ``stale_prefix: mask``
    its newest token's (its tokens older than the bound are then left out of the loss: :func:`fresh_loss_mask`).
    """
    return newest if stale_prefix == "mask" else oldest


def fresh_loss_mask(loss_mask: Sequence[int], token_versions: Sequence[int], fresh: Callable[[int], bool]) -> list[int]:
    """``loss_mask`` with every token whose version is not ``fresh`` (older than the bound) set to 0: it stays
    in the sequence as context, and no gradient flows through it."""
    verdicts: dict[int, bool] = {}  # a handful of versions per episode
    out = []
    for m, v in zip(loss_mask, token_versions, strict=True):
        if m and v not in verdicts:
            verdicts[v] = fresh(v)
        out.append(int(bool(m) and verdicts[v]) if m else 0)
    return out


@dataclass(slots=True)
class RecentSet:
    """The newest ``keep`` integers added (stream sequences the trainer handled): bounded for any run length."""

    keep: int
    _items: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def __contains__(self, item: int) -> bool:
        return item in self._items

    def add(self, item: int) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        while len(self._items) > self.keep:
            self._items.popitem(last=False)
