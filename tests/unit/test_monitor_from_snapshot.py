"""Observers that start late start from the controller's snapshot: the monitor's totals are the run record's fold
(miles.actors.step_totals), so a monitor that reads only what the streams kept after a purge shows what one that
read every report shows; `miles run`'s progress view resumes where the snapshot stands."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

from rich.console import Console

from miles.actors.admission import AdmissionState
from miles.actors.run_record import RunRecord
from miles.actors.step_totals import StepTotals
from miles.actors.weight_audit import WeightAudit
from miles.bus.client import Bus
from miles.bus.schema import (
    ControllerSnapshot,
    EvalResult,
    EvaluationPart,
    StepMetrics,
    WeightsAnnounced,
    decode,
    encode,
)
from miles.config import load_config
from miles.monitoring.state import RunState
from miles.progress import ProgressView

STEPS = 15
SNAPSHOT_STEPS = 10  # steps 0-9 in the snapshot
KEPT_FROM = 6  # what the streams still hold after the purge: steps 6-14 (6-9 counted by the snapshot too)


def _step(step: int, *, replayed: bool = False) -> StepMetrics:
    ids = [f"g{3 * step + i}" for i in range(3)]
    return StepMetrics(
        step=step,
        policy_version=step + 1,
        trained_group_ids=ids,
        staleness=[step % 3, (step + 1) % 3, 2],
        metrics={"reward_mean": step / 20, "samples": 12.0, "episodes": 12.0, "truncated": float(step % 2)},
        replayed=replayed,
    )


def _eval(version: int, accuracy: float) -> EvalResult:
    return EvalResult(
        policy_version=version, requested_version=version, accuracy=accuracy, samples=8, eval_id=f"v{version}"
    )


def _complete(result: EvalResult) -> EvaluationPart:
    return EvaluationPart(
        eval_id=result.eval_id,
        version=result.requested_version,
        sizes=[8],
        results=[],
        counted=[0],
        reissued=[],
        result=result,
    )


def _snapshot(tmp_path: Path, steps: int, *, metrics_position: int = 0) -> ControllerSnapshot:
    """The controller's snapshot after its run record folded ``steps`` steps and the evaluations of version 0 (step
    0) and version 5 (step 5), through the wire."""
    record = RunRecord(tmp_path / "record")
    for step in range(steps):
        record.step(_step(step), t=float(step))
    record.eval(_eval(0, 0.25), step=0, t=0.0)
    record.eval(_eval(5, 0.5), step=5, t=5.0)
    snapshot = ControllerSnapshot(
        positions={"metrics": metrics_position, "weights": 0, "discarded": 0, "weights_held": 0, "eval_results": 0},
        admission=AdmissionState().part(),
        last_batch=None,
        trainer_version=steps,
        trainer_step=steps,
        version_steps=[(version, version) for version in range(steps + 1)],
        sync_bytes={},
        audit=WeightAudit().part(),
        evaluations=[_complete(_eval(0, 0.25)), _complete(_eval(5, 0.5))],
        due_evals=[],
        trainer_done=None,
        refused={},
        dead_lettered=0,
        record=record.part(),
    )
    record.close()
    return decode(encode(snapshot), ControllerSnapshot)


def _state() -> RunState:
    return RunState(run="r", max_staleness=2, reward_points=5)


def test_a_monitor_started_from_a_snapshot_shows_what_one_that_read_every_report_shows(tmp_path: Path) -> None:
    everything = _state()
    everything.on_weights(WeightsAnnounced(version=0, step=0, digest="d" * 32, size=1, chunks=1))
    everything.on_eval(_eval(0, 0.25))
    for step in range(STEPS):
        everything.on_weights(WeightsAnnounced(version=step + 1, step=step + 1, digest="d" * 32, size=1, chunks=1))
        everything.on_step(_step(step), t=float(step))
        if step == 4:
            everything.on_eval(_eval(5, 0.5))

    late = _state()
    late.start_from(_snapshot(tmp_path, SNAPSHOT_STEPS))
    for step in range(KEPT_FROM, STEPS):  # the reports the purge left, read again from the first one kept
        late.on_weights(WeightsAnnounced(version=step + 1, step=step + 1, digest="d" * 32, size=1, chunks=1))
        late.on_step(_step(step), t=float(step))
    late.on_step(_step(3, replayed=True), t=20.0)  # a lost step re-trained after a trainer restart: counted once

    a, b = everything.snapshot(100.0), late.snapshot(100.0)
    for key in ("steps_seen", "staleness_histogram", "staleness_mean", "trained", "reward", "lengths", "evals"):
        assert a[key] == b[key], key
    assert b["steps_seen"] == STEPS and sum(b["staleness_histogram"].values()) == 3 * STEPS
    assert b["trained"]["samples"] == 12 * STEPS and b["trained"]["truncated"] == STEPS // 2
    assert b["evals"] == {"0": 0.25, "5": 0.5}  # both purged from METRICS: known from the snapshot
    assert late.totals.replayed == 1


def test_the_step_totals_survive_the_snapshot_and_count_a_step_once(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path, 4)
    totals = StepTotals.from_part(snapshot.record.steps)
    assert len(totals.steps) == 4 and totals.groups == 12 and totals.sums["samples"] == 48.0
    assert not totals.add(_step(2))
    assert totals.add(_step(4)) and totals.groups == 15 and totals.staleness_max == 2


def test_an_evaluation_keeps_its_step_after_the_version_map_forgot_the_version() -> None:
    state = _state()
    state.versions = type(state.versions)(2)  # a map that keeps two versions
    state.on_eval(_eval(3, 0.75))  # arrives before its version's announcement
    for version in range(1, 8):
        state.on_weights(WeightsAnnounced(version=version, step=version, digest="d" * 32, size=1, chunks=1))
    assert 3 not in state.versions
    assert state.snapshot(1.0)["evals"] == {"3": 0.75}


async def test_the_progress_view_resumes_where_the_snapshot_stands(nats_server: str, tmp_path: Path) -> None:
    cfg = load_config(None, ["name=resumed", f"trainer.steps={STEPS}", "bus.secure=false"])
    bus = await Bus.open(cfg.bus, nats_server, cfg.name, "writer", role="controller")
    s = bus.subjects
    for step in range(SNAPSHOT_STEPS):
        await bus.publish(s.step, _step(step))
    ack = await bus.publish(s.snapshot, _snapshot(tmp_path, SNAPSHOT_STEPS, metrics_position=SNAPSHOT_STEPS))
    assert ack.seq == 1
    await bus.publish(s.step, _step(SNAPSHOT_STEPS))

    view = ProgressView(cfg, nats_server)
    out = io.StringIO()
    view.console = Console(file=out, width=200)
    view._print_every = 1
    await view.start()
    try:
        async with asyncio.timeout(30):
            while f"step {SNAPSHOT_STEPS + 1}/{STEPS}" not in out.getvalue():
                await view.refresh()
                await asyncio.sleep(0.05)
    finally:
        await view.close()
        await bus.close()
    lines = [line for line in out.getvalue().splitlines() if not line.startswith("miles run")]
    assert lines[0] == f"resuming at step {SNAPSHOT_STEPS}/{STEPS}"
    assert lines[1].startswith(f"step {SNAPSHOT_STEPS + 1}/{STEPS} |") and lines[1].endswith("| eval 0.500")
    assert len(lines) == 2  # the reports the snapshot counted are not shown again
