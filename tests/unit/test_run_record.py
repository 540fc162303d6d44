"""The run record's files: a live line is readable at once, a rebuild rewrites each file once through one open
handle, and closing is idempotent."""

from __future__ import annotations

import json
from pathlib import Path

from miles.actors.run_record import RunRecord
from miles.bus.schema import GroupsIssued, StepMetrics


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _batch(first: int) -> GroupsIssued:
    return GroupsIssued(first_index=first, sample_ids=["a", "b"], attempts=[0, 0], issued_at_version=0, cursor=2)


def _step(step: int) -> StepMetrics:
    ids = [f"g{2 * step}", f"g{2 * step + 1}"]
    return StepMetrics(step=step, policy_version=step + 1, trained_group_ids=ids, staleness=[0, 1], metrics={})


def test_live_lines_are_readable_at_once_and_a_rebuild_writes_each_once(tmp_path: Path) -> None:
    record = RunRecord(tmp_path)
    record.issued(_batch(0), t=1.0)
    record.step(_step(0), t=2.0)
    assert [row["event"] for row in _lines(record.ledger_path)] == ["issued", "issued", "trained", "trained"]
    assert [row["step"] for row in _lines(record.metrics_path)] == [0]
    record.close()

    again = RunRecord(tmp_path)  # a restarted controller replays the same messages
    again.begin_rebuild()
    assert record.ledger_path.read_text() == ""
    again.issued(_batch(0), t=1.0)
    again.step(_step(0), t=2.0)
    again.step(_step(0), t=2.0)  # a step seen twice is recorded once
    again.end_rebuild()
    assert len(_lines(again.ledger_path)) == 4 and len(_lines(again.metrics_path)) == 1
    again.issued(_batch(2), t=3.0)  # live again: flushed at once
    assert len(_lines(again.ledger_path)) == 6
    again.close()
    again.close()


def test_the_summary_totals_stay_bounded_and_exact(tmp_path: Path) -> None:
    """Staleness and the steps seen are kept as totals and an index set, not one entry per group or step."""
    record = RunRecord(tmp_path)
    for step in range(50):
        record.step(_step(step), t=float(step))
    summary = record.write_summary()
    assert summary["staleness_mean"] == 0.5 and summary["staleness_max"] == 1
    assert summary["trajectories_trained"] == 100 and len(record.totals.steps) == 50
    assert record.totals.steps.floor == 50 and not record.totals.steps.above  # one integer for 50 steps
    record.close()
