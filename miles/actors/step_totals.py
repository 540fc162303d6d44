"""The run's totals over its step reports: one fold, kept by the controller's run record and by every monitor.

A step report (:class:`~miles.bus.schema.StepMetrics`) counts once, however often it is read: a trainer that
re-trains a lost step after a restart sends that step again (``replayed``), and a reader that starts over reads
the stored reports again. Both readers fold the same way, so ``summary.json`` and ``miles top`` agree, and both
start from the controller's snapshot (:class:`~miles.bus.schema.StepTotalsPart`), so a run whose oldest reports
were purged (``bus.retention: recovery``) still adds up from its first step. The state is bounded for a run of
any length: the steps as an :class:`~miles.training.lineage.IndexSet`, staleness as a histogram.
"""

from __future__ import annotations

from miles.bus.schema import StepMetrics, StepTotalsPart
from miles.training.lineage import IndexSet

# Step metrics that count episodes or events of the step (not per-step means): summed over the steps.
SUMMED = (
    "samples",
    "episodes",
    "infra_excluded",
    "reward_failed",
    "truncated",
    "groups_without_signal",
    "sandbox_failures",
    "tool_calls",
    "parse_errors",
    "template_mismatches",
    "model_tokens",  # sampled tokens of the trained batches
    "stale_tokens_masked",  # of which left out of the loss as too old (staleness.stale_prefix: mask)
)


class StepTotals:
    """Steps counted, trained groups per staleness, and the :data:`SUMMED` metrics over those steps."""

    def __init__(self) -> None:
        self.steps = IndexSet()
        self.staleness: dict[int, int] = {}  # staleness (steps) -> trained groups
        self.sums: dict[str, float] = {}
        self.replayed = 0  # reports of a step counted before, re-trained after a trainer restart

    def add(self, msg: StepMetrics) -> bool:
        """Count ``msg``; False (and nothing counted) if its step was counted before."""
        if msg.step in self.steps:
            self.replayed += int(msg.replayed)
            return False
        self.steps.add(msg.step)
        for lag in msg.staleness:
            self.staleness[lag] = self.staleness.get(lag, 0) + 1
        for key in SUMMED:
            if key in msg.metrics:
                self.sums[key] = self.sums.get(key, 0.0) + msg.metrics[key]
        return True

    @property
    def groups(self) -> int:
        """Trained groups (one staleness entry each)."""
        return sum(self.staleness.values())

    @property
    def staleness_mean(self) -> float:
        groups = self.groups
        return sum(lag * n for lag, n in self.staleness.items()) / groups if groups else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness, default=0)

    def part(self) -> StepTotalsPart:
        return StepTotalsPart(
            steps_floor=self.steps.floor,
            steps_above=sorted(self.steps.above),
            staleness=sorted(self.staleness.items()),
            sums=dict(self.sums),
            replayed=self.replayed,
        )

    @classmethod
    def from_part(cls, part: StepTotalsPart) -> StepTotals:
        totals = cls()
        totals.steps = IndexSet.from_json({"floor": part.steps_floor, "above": part.steps_above})
        totals.staleness = dict(part.staleness)
        totals.sums = dict(part.sums)
        totals.replayed = part.replayed
        return totals
