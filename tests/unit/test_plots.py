"""End-of-run plots from a synthetic metrics.jsonl and evals.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.monitoring.plots import LENGTHS_PNG, REWARD_PNG, STALENESS_PNG, read_evals, read_metrics, write_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _record(run_dir: Path, steps: int) -> None:
    """What miles.actors.run_record writes: one metrics line per step, one evals line per evaluation."""
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(steps):
            row = {
                "step": s,
                "policy_version": s + 1,
                "reward_mean": 0.2 + 0.01 * s,
                "staleness_mean": (s % 3) / 2,
                "staleness_max": s % 3,
                "tokens_per_s": 100.0,
                "length_mean": 20.0 + s,
                "length_p50": 18.0 + s,
                "length_p90": 40.0 + s,
                "length_max": 64.0,
                "grad_norm": None,  # a skipped step's non-finite norm
            }
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps({"step": 3, "policy_version": 4, "reward_mean": 0.5}) + "\n")  # a replayed line
    with open(run_dir / "evals.jsonl", "w") as f:
        for step in (0, 5, 10, 15, 20):
            line = {"step": step, "requested_version": step, "policy_version": step, "eval_accuracy": 0.3 + 0.01 * step}
            f.write(json.dumps({**line, "samples": 40, "failed": 0}) + "\n")
        f.write(json.dumps({"step": 5, "eval_accuracy": 0.99, "samples": 40, "failed": 0}) + "\n")  # re-sent


def test_plots_are_valid_pngs(tmp_path: Path) -> None:
    _record(tmp_path, 20)
    assert len(read_metrics(tmp_path)) == 20
    expected = {0: 0.3, 5: 0.35, 10: 0.4, 15: 0.45, 20: 0.5}
    assert read_evals(tmp_path) == pytest.approx(expected)  # the first line of a step wins
    paths = write_plots(tmp_path, max_staleness=2, evals={0: 0.25}, run_name="demo")
    assert [p.name for p in paths] == [REWARD_PNG, STALENESS_PNG, LENGTHS_PNG]
    for path in paths:
        width, height = _png_size(path)
        assert width > 300 and height > 200
        assert path.stat().st_size > 10_000  # drawn, not blank


def test_plots_without_metrics(tmp_path: Path) -> None:
    paths = write_plots(tmp_path)
    assert len(paths) == 3
    assert all(p.exists() and p.read_bytes()[:8] == PNG_MAGIC for p in paths)


def test_lengths_plot_of_single_turn_record_without_lengths(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.1}) + "\n")
    paths = write_plots(tmp_path, max_staleness=1)
    assert (tmp_path / LENGTHS_PNG) in paths and (tmp_path / LENGTHS_PNG).read_bytes()[:8] == PNG_MAGIC
