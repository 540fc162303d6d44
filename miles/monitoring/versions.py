"""The lineage step of each policy version the monitor has heard of.

Versions are unique ids, not step counts: after a trainer restart the versions published past its checkpoint
are superseded by new, higher ids whose lineage steps restart from the checkpoint. A worker's lag is therefore
``trainer step - step of the worker's version``, and this map is what turns a version into a step. Every message
that pairs the two feeds it: weight announcements (``WeightsAnnounced.step``), step reports (step ``s`` publishes
the version trained ``s + 1`` batches), the trainer's and controller's heartbeats and ``TrainerDone``.
"""

from __future__ import annotations

KEEP_VERSIONS = 65_536  # far more than any worker lags behind; bounds memory on endless runs


class VersionSteps:
    """``version -> lineage step``, keeping the ``keep`` newest versions."""

    def __init__(self, keep: int = KEEP_VERSIONS) -> None:
        self.keep = keep
        self._steps: dict[int, int] = {}

    def learn(self, version: int, step: int) -> None:
        """Record that ``version`` holds ``step`` rollout batches (negative versions are 'none yet')."""
        if version < 0 or step < 0:
            return
        self._steps[version] = step
        if len(self._steps) > self.keep:  # one over at a time: drop the oldest version
            del self._steps[min(self._steps)]

    def step_of(self, version: int) -> int | None:
        return self._steps.get(version)

    def newest(self) -> tuple[int, int] | None:
        """``(version, step)`` of the highest version known: the trainer's current lineage head."""
        if not self._steps:
            return None
        version = max(self._steps)
        return version, self._steps[version]

    def __len__(self) -> int:
        return len(self._steps)
