"""The benchmark scripts still run on this tree (an unused script goes stale: async_vs_sync.py once stopped
on a removed config key and read a metric that no longer existed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_async_vs_sync_runs_both_tasks_and_reports_ratios(tmp_path: Path) -> None:
    out = tmp_path / "avs.json"
    # Two steps, one eta each (a short warm-up: the smoke test checks the script, not the figures).
    proc = subprocess.run(
        [sys.executable, "benchmarks/async_vs_sync.py", "--etas", "0,1", "--uniform-etas", "0", "--out", str(out)]
        + [
            x
            for o in ("trainer.steps=2", "model.warmup_steps=5", "model.warmup_target_accuracy=null")
            for x in ("--set", o)
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {r["label"]: r for r in result["runs"]}
    assert set(runs) == {"long-tailed-eta0", "long-tailed-eta1", "uniform-eta0"}
    for r in runs.values():
        assert "error" not in r and r["steps"] == 2 and r["tokens_trained"] > 0 and r["tokens_per_s"] > 0
    assert runs["long-tailed-eta1"]["samples_per_s_vs_eta0"] > 0
    assert result["tasks"]["long-tailed"]["budget"]["groups_in_flight"] == 4
    assert "| long-tailed | 1 |" in proc.stdout


@pytest.mark.slow
def test_controller_restart_rebuilds_a_synthetic_run_exactly(tmp_path: Path) -> None:
    """The restart benchmark fills real streams and runs the controller's real rebuild, which it checks itself
    (nothing refused, every group accounted for): a small run must pass those checks."""
    out = tmp_path / "restart.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/controller_restart.py", "--steps", "30", "--repeats", "1", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["steps"] == 30 and row["messages"] == 1 + 3 * 30 + 3 and row["record_bytes_rewritten"] > 0
