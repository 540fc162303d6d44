"""The run's scalars to TensorBoard event files and an offline W&B run; both optional packages."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from miles.monitoring import tensorboard as tb
from miles.monitoring.scalars import RunScalars
from miles.monitoring.tensorboard import TENSORBOARD_DIR, TensorboardWriter, scalars
from miles.monitoring.wandb_offline import WandbWriter


def _line(step: int) -> dict:
    """A metrics.jsonl line as miles.actors.run_record writes it."""
    return {
        "step": step,
        "policy_version": step + 1,
        "reward_mean": 0.1 * step,
        "length_p90": 40.0,
        "grad_norm": None if step == 1 else 2.0,  # a skipped step
        "time": 12.5,
    }


def test_scalars_keeps_finite_numbers_only() -> None:
    got = scalars({"step": 3, "a": 1, "b": 2.5, "c": None, "d": math.nan, "e": math.inf, "f": True, "g": "x"})
    assert got == {"a": 1.0, "b": 2.5}


@pytest.fixture
def without(monkeypatch: pytest.MonkeyPatch):
    """Make modules unimportable (a None entry in sys.modules raises ImportError) and forget cached lookups."""

    def hide(*names: str) -> None:
        for name in names:
            monkeypatch.setitem(sys.modules, name, None)
        tb._summary_writer.cache_clear()

    yield hide
    tb._summary_writer.cache_clear()


def test_tensorboard_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb._summary_writer.cache_clear()
    writer = TensorboardWriter(tmp_path)
    assert writer.available
    writer.eval(0.25, 0)
    for step in range(3):
        writer.step(_line(step), step)
    writer.eval(0.5, 3)
    writer.close()
    writer.close()  # idempotent
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"train/reward_mean", "train/length_p90", "train/grad_norm", "eval/accuracy"}
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("train/reward_mean")] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert [e.step for e in events.Scalars("train/grad_norm")] == [0, 2]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, 0.25), (3, 0.5)]


@pytest.mark.parametrize("hidden", [("tensorboard",), ("tensorboard.summary.writer.event_file_writer",)])
def test_tensorboard_missing_writes_nothing_and_says_so_once(tmp_path: Path, without, hidden: tuple[str, ...]) -> None:
    without(*hidden)
    with capture_logs() as logs:
        first, second = TensorboardWriter(tmp_path), TensorboardWriter(tmp_path / "other")
    assert not first.available and not second.available
    first.step(_line(0), 0)
    first.eval(0.5, 0)
    first.close()
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    assert [entry["event"] for entry in logs] == ["tensorboard_unavailable"]


def test_run_scalars_without_any_tracker(tmp_path: Path, without) -> None:
    without("tensorboard", "wandb")
    with capture_logs() as logs:
        sinks = RunScalars(tmp_path, run_name="demo", wandb=True, config={"name": "demo"})
    sinks.step(_line(0), 0)
    sinks.eval(0.5, 0)
    sinks.close()
    assert {entry["event"] for entry in logs} == {"tensorboard_unavailable", "wandb_unavailable"}
    assert list(tmp_path.iterdir()) == []


def test_wandb_offline_run(tmp_path: Path, without) -> None:
    pytest.importorskip("wandb")
    without("tensorboard")
    writer = WandbWriter(tmp_path, run_name="demo", config={"trainer": {"steps": 3}})
    assert writer.available
    writer.eval(0.25, 0)
    for step in range(3):
        writer.step(_line(step), step)
    writer.eval(0.5, 2)  # an eval that arrives after later steps: its own step axis
    writer.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
