"""The benchmark scripts still run on this tree (an unused script goes stale: async_vs_sync.py once stopped
on a removed config key and read a metric that no longer existed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Two steps after a short warm-up: a smoke test checks the script, not the figures.
SHORT_RUN = [
    x for o in ("trainer.steps=2", "model.warmup_steps=5", "model.warmup_target_accuracy=null") for x in ("--set", o)
]


def run_script(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<script>`` from the repository root; fail with its stderr's tail if it fails."""
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_async_vs_sync_runs_both_tasks_and_reports_ratios(tmp_path: Path) -> None:
    out = tmp_path / "avs.json"
    # Two steps, one eta each.
    sets = SHORT_RUN
    proc = run_script("async_vs_sync.py", "--etas", "0,1", "--uniform-etas", "0", "--out", str(out), *sets, timeout=540)
    result = json.loads(out.read_text())
    runs = {r["label"]: r for r in result["runs"]}
    assert set(runs) == {"long-tailed-eta0", "long-tailed-eta1", "uniform-eta0"}
    for r in runs.values():
        assert "error" not in r and r["steps"] == 2 and r["tokens_trained"] > 0 and r["tokens_per_s"] > 0
    assert runs["long-tailed-eta1"]["samples_per_s_vs_eta0"] > 0
    assert result["tasks"]["long-tailed"]["budget"]["groups_in_flight"] == 4
    assert "| long-tailed | 1 |" in proc.stdout


@pytest.mark.slow
def test_stale_prefix_runs_every_arm_and_counts_their_tokens(tmp_path: Path) -> None:
    out = tmp_path / "sp.json"
    sets = SHORT_RUN
    proc = run_script(
        "stale_prefix.py", "--seeds", "0", "--admit-by", "groups", "episodes", "--out", str(out), *sets, timeout=540
    )
    runs = json.loads(out.read_text())["runs"]
    arms = {(r["stale_prefix"], r["admit_by"]) for r in runs}
    assert arms == {(m, a) for m in ("discard", "mask") for a in ("groups", "episodes")}
    for r in runs:
        assert "error" not in r and r["model_tokens_sampled"] > 0 and r["regenerated_fraction"] is not None
    assert "| mask | episodes | 1 |" in proc.stdout


@pytest.mark.slow
def test_controller_restart_rebuilds_a_synthetic_run_exactly(tmp_path: Path) -> None:
    """The restart benchmark fills real streams and runs the controller's real rebuild, which it checks itself
    (nothing refused, every group accounted for): a run must pass those checks. 300 steps: more versions than
    the controller's version map keeps (256), so the replay without a snapshot must read each announcement as
    the step reports need it (read all first, the early reports were refused as never announced)."""
    out = tmp_path / "restart.json"
    args = ["--steps", "300", "--tail", "5", "--repeats", "1"]
    run_script("controller_restart.py", *args, "--out", str(out), timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["steps"] == 300 and row["messages"] == 1 + 3 * 300 + 30
    assert row["steps_after_snapshot"] == 5  # the restart replays the steps after the snapshot only
    assert 0 < row["restart_record_bytes"] < row["full_replay_record_bytes"]


@pytest.mark.slow
def test_the_soak_runs_samples_and_restarts_the_controller(tmp_path: Path) -> None:
    """The soak run completes exact (the script checks the summary), sampling the streams and restarting the
    controller on the way."""
    out = tmp_path / "soak.json"
    args = ["--steps", "150", "--every", "50", "--restart-every", "100", "--checkpoint-every", "20"]
    run_script("soak.py", *args, "--out", str(out), timeout=400)
    rows = json.loads(out.read_text())["rows"]
    assert [row["steps"] >= target for row, target in zip(rows, (50, 100), strict=True)] == [True, True]
    assert "restart_rebuild_s" in rows[1] and rows[1]["controller_life"] == 1


@pytest.mark.slow
def test_trainer_intake_runs_the_real_trainer_loop_over_every_group(tmp_path: Path) -> None:
    """The intake benchmark drives the real trainer loop over filled streams and checks that every group was
    trained once with nothing refused: a small run must pass that check and report each step."""
    out = tmp_path / "intake.json"
    args = ["--groups", "8", "--group-size", "2", "--tokens", "40", "--train-s", "0.05", "--steps", "3"]
    run_script("trainer_intake.py", *args, "--out", str(out), timeout=300)
    result = json.loads(out.read_text())
    assert len(result["step_s"]) == 3 and result["step_s_median_after_first"] >= 0.05
