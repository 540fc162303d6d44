"""``miles run`` as a user runs it: one command, an embedded and secured NATS, every actor a process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.config import dump_config
from tests.integration.harness import small_run_config


def _miles_run(
    recipe: Path, run_dir: Path, *sets: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "miles.cli", "run", str(recipe), "--run-dir", str(run_dir), "--quiet"]
    for item in sets:
        cmd += ["--set", item]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


@pytest.fixture
def recipe(tmp_path: Path, model_cache: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    cfg = small_run_config(model_cache, "mrun", **{"trainer.steps": 5, "eval.every": 0, "monitor.plots": False})
    path.write_text(dump_config(cfg))
    return path


@pytest.mark.slow
def test_the_default_run_is_secured_and_completes_without_a_refusal(recipe: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _miles_run(recipe, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bus tls://127.0.0.1:" in proc.stderr  # the embedded server speaks TLS
    assert (run_dir / "auth" / "bundle.json").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 5
    # Every actor logged in with its own identity and every signed message verified: nothing refused.
    assert summary["dead_lettered"] == 0 and summary["refused"] == {} and summary["alarms"] == []
    assert summary["weights_verified"] > 0 and summary["weights_mismatches"] == 0
    server_log = (run_dir / "nats" / "nats-server.log").read_text()
    assert "Violation" not in server_log  # no role tried anything its permissions do not allow


@pytest.mark.slow
def test_a_run_that_ends_early_exits_non_zero_with_the_reason(recipe: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # The trainer dies before its third step (SIGKILL, like the OOM killer); nobody restarts it.
    proc = _miles_run(recipe, run_dir, "bus.secure=false", env={"MILES_FAILPOINTS": "between_steps:3"})
    assert proc.returncode != 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "incomplete"
    assert "trainer" in summary["reason"]
    assert not (run_dir / "auth").exists()  # bus.secure: false is an open bus, no credentials made


@pytest.mark.slow
def test_a_run_syncs_over_a_weight_update_group(recipe: Path, tmp_path: Path) -> None:
    """Both sides of the weight-sync component come from one registry entry: the trainer's sender and every
    worker's receiver meet (two workers join the broadcast group) and each version is verified. (The fs
    transport's two sides are tested in test_transports.py.)"""
    run_dir = tmp_path / "run"
    proc = _miles_run(recipe, run_dir, "sync.transport=broadcast", "rollout.workers=2", "bus.secure=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["weights_mismatches"] == 0
    # Each worker adopted and verified versions (a busy worker may skip a version a newer one replaced before
    # its engine switched: every round reaches every member, not every version is adopted by each).
    assert summary["weights_verified"] >= 2
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert logs.count("weight_group.joined") == 3  # the trainer and both workers, one group
    assert "weights_transport_fallback" not in logs  # no version had to go over the bus instead


def _processes_naming(run_dir: Path) -> set[int]:
    """Live processes whose command line names the run directory: the launcher, its actors, its nats-server."""
    marker = str(run_dir).encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():  # a zombie's is empty
                    pids.add(int(entry.name))
            except OSError:  # it ended while we looked
                continue
    return pids


def _wait_until(condition, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_killed_launcher_leaves_no_actor_running(tmp_path: Path, model_cache: Path, sig: signal.Signals) -> None:
    """A scheduler's SIGTERM stops the run like Ctrl-C (actors stopped, summary says why, exit 143); after a
    SIGKILL the actors and the server, each in its own session, still get SIGTERM from the kernel."""
    recipe = tmp_path / "long.yaml"
    # An outage budget far longer than the test waits: an actor that merely outlived its bus would pass otherwise.
    cfg = small_run_config(
        model_cache,
        "mkill",
        **{"trainer.steps": 10_000, "eval.every": 0, "monitor.plots": False, "bus.outage_budget_s": 900.0},
    )
    recipe.write_text(dump_config(cfg))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles.cli", "run", str(recipe), "--run-dir", str(run_dir), "--quiet"]
    with open(tmp_path / "launcher.log", "wb") as out:
        launcher = subprocess.Popen(cmd + ["--set", "bus.secure=false"], stdout=out, stderr=subprocess.STDOUT)
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_until(lambda: metrics.exists() and metrics.stat().st_size > 0, 300, "the first trained step")
        children = _processes_naming(run_dir) - {launcher.pid}
        assert len(children) >= 4, children  # nats-server, controller, a rollout worker, a trainer rank
        launcher.send_signal(sig)
        code = launcher.wait(timeout=120)
        try:
            _wait_until(lambda: not (children & _processes_naming(run_dir)), 90, "the actors to exit")
        except AssertionError as exc:
            left = children & _processes_naming(run_dir)
            alive = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left}
            raise AssertionError(f"{exc}; still alive: {alive}") from None
    finally:
        if launcher.poll() is None:
            launcher.kill()
    if sig == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM, (tmp_path / "launcher.log").read_text()[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "incomplete" and "SIGTERM" in summary["reason"]
    else:
        assert code == -signal.SIGKILL
