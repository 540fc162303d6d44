"""The trainer's memory of versions and groups, bounded for a run of any length.

**Versions** are unique ids; a version's *step* is how many rollout batches were trained into its weights.
Without restarts the two are equal. A trainer that restarts from a checkpoint at step ``c`` supersedes the
versions it had published after it: they stay valid ids (workers may still be generating with them) but
lie on a dead branch. :class:`VersionLineage` measures how far behind the current weights a version is, in
optimizer steps of rollout batches:

* a version on the surviving lineage at step ``s``: ``current - s``;
* a version on a dead branch at step ``d`` that forked off at step ``f``: ``(d - f) + (current - f)``
  (back to the fork, then forward), never less than its distance before the restart;
* an unknown version: ``None`` (refused: it was never published by this trainer, or is too old to matter).

**Every actor's version map** (:class:`VersionSteps`: the controller's, its weight audit's, the monitor's, the
progress bar's) and the trainer's lineage keep the same number of the newest versions, :func:`versions_kept`:
tied to the staleness bound, with room for what arrives late about an older version (an evaluation's result,
a held-weight report, the heartbeat of a worker that fell behind).

**Groups** are numbered by the controller (``g<issue index>``). :class:`IndexSet` keeps the indexes the
trainer has resolved (trained or discarded) as a floor below which every index is resolved plus the few
resolved ones above it, so checking "already trained?" stays exact without a set that grows for ever.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class IndexSet:
    """Non-negative integers seen, stored as ``[0, floor)`` plus a sparse set above the floor."""

    floor: int = 0
    above: set[int] = field(default_factory=set)

    def __contains__(self, index: int) -> bool:
        return index < self.floor or index in self.above

    def add(self, index: int) -> None:
        if index < self.floor:
            return
        self.above.add(index)
        while self.floor in self.above:
            self.above.remove(self.floor)
            self.floor += 1

    def __len__(self) -> int:
        return self.floor + len(self.above)

    def to_json(self) -> dict[str, Any]:
        return {"floor": self.floor, "above": sorted(self.above)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IndexSet:
        out = cls(int(data["floor"]))
        for index in data["above"]:
            out.add(int(index))
        return out


MIN_VERSIONS_KEPT = 256  # an evaluation's result or a lagging worker's report is never this many versions late


def versions_kept(max_staleness: int) -> int:
    """How many of the newest versions every version map and the trainer's lineage remember: four staleness
    windows, and never fewer than :data:`MIN_VERSIONS_KEPT`."""
    return max(MIN_VERSIONS_KEPT, 4 * (max_staleness + 1))


class VersionSteps(Mapping[int, int]):
    """``version -> lineage step`` of the ``keep`` newest versions (a version's step turns a worker's version
    into its lag: versions are unique ids, and a trainer restart publishes new ids at earlier steps)."""

    def __init__(self, keep: int = MIN_VERSIONS_KEPT) -> None:
        self.keep = keep
        self._steps: dict[int, int] = {}

    def learn(self, version: int, step: int) -> None:
        """Record that ``version`` holds ``step`` rollout batches (negative versions are 'none yet')."""
        if version < 0 or step < 0:
            return
        self._steps[version] = step
        if len(self._steps) > self.keep:  # one over at a time: drop the oldest version
            del self._steps[min(self._steps)]

    def restore(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Take ``(version, step)`` pairs (a snapshot's), forgetting what was known."""
        self._steps = {}
        for version, step in pairs:
            self.learn(version, step)

    def step_of(self, version: int) -> int | None:
        return self._steps.get(version)

    def newest(self) -> tuple[int, int] | None:
        """``(version, step)`` of the highest version known: the trainer's current lineage head."""
        if not self._steps:
            return None
        version = max(self._steps)
        return version, self._steps[version]

    def __getitem__(self, version: int) -> int:
        return self._steps[version]

    def __iter__(self) -> Iterator[int]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)


@dataclass(slots=True)
class VersionLineage:
    """Version -> step of the surviving lineage, and of superseded (dead-branch) versions with their fork."""

    alive: dict[int, int] = field(default_factory=dict)
    dead: dict[int, tuple[int, int]] = field(default_factory=dict)  # version -> (step, fork step)
    keep_steps: int = 64  # versions more than this many steps behind are forgotten (refused as too stale)

    @property
    def version(self) -> int:
        return max(self.alive) if self.alive else -1

    @property
    def step(self) -> int:
        return self.alive[self.version] if self.alive else 0

    def advance(self, version: int, step: int) -> None:
        if self.alive and version <= self.version:
            raise ValueError(f"version {version} is not newer than {self.version}: versions are never reused")
        self.alive[version] = step
        self._prune()

    def supersede(self, versions: dict[int, int], fork_step: int) -> None:
        """Mark ``{version: step}`` (published after the restored checkpoint at ``fork_step``) as dead."""
        for version, step in versions.items():
            self.alive.pop(version, None)
            self.dead[version] = (step, fork_step)

    def distance(self, version: int) -> int | None:
        """Optimizer steps (rollout batches) between ``version``'s weights and the current ones."""
        if version in self.alive:
            return self.step - self.alive[version]
        if version in self.dead:
            step, fork = self.dead[version]
            return (step - fork) + (self.step - fork)
        return None

    def _prune(self) -> None:
        horizon = self.step - self.keep_steps
        self.alive = {v: s for v, s in self.alive.items() if s >= horizon or v == self.version}
        self.dead = {v: (s, f) for v, (s, f) in self.dead.items() if f >= horizon}

    def to_json(self) -> dict[str, Any]:
        return {
            "alive": [[v, s] for v, s in sorted(self.alive.items())],
            "dead": [[v, s, f] for v, (s, f) in sorted(self.dead.items())],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], keep_steps: int = 64) -> VersionLineage:
        return cls(
            alive={int(v): int(s) for v, s in data["alive"]},
            dead={int(v): (int(s), int(f)) for v, s, f in data["dead"]},
            keep_steps=keep_steps,
        )
