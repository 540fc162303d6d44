"""The monitor against a real run: ``--json --once`` snapshot, a live Prometheus endpoint, end-of-run plots.

Lags are checked in lineage steps (from the replayed weight announcements), the episode counters of the
schema-2 heartbeats and step metrics reach the snapshot, and the record's evals.jsonl feeds the plots.

A controller, two rollout workers and a trainer run as ``miles-node`` processes on a real
nats-server; the monitor attaches as one more process, read-only, as it would from another machine.
A tiny run trains a step in ~0.1 s, so the trainer is paused (SIGSTOP) while the monitor looks:
the run is then reliably mid-flight, with work piling up in the queues, whatever the machine's pace.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from miles.bus.server import EmbeddedNats
from miles.launch import node_command
from miles.monitoring.prom import METRIC_NAMES

from .harness import Cluster, small_run_config

pytestmark = pytest.mark.slow

STEPS = 40


def _monitor_cmd(cluster: Cluster, actor_id: str, *extra: str) -> list[str]:
    return node_command(
        "monitor", cluster.config_path, cluster.run_dir / "monitor", cluster.nats_url, "--actor-id", actor_id, *extra
    )


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise AssertionError("the monitor printed no snapshot")
    return proc.stdout.readline().decode()


def _scrape(port: int, until: str, timeout_s: float = 15.0) -> str:
    """GET /metrics until it contains ``until`` (the first snapshot may precede the first heartbeats)."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            text = ""
        if until in text:
            return text
        time.sleep(0.3)
    raise AssertionError(f"/metrics never showed {until!r}:\n{text}")


def test_monitor_json_prometheus_and_plots(tmp_path: Path, server: EmbeddedNats) -> None:
    cfg = small_run_config(tmp_path / "models", "mon", **{"trainer.steps": STEPS, "eval.every": 8})
    from miles.prepare import prepare

    prepare(cfg)
    cluster = Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=server.url)
    live: subprocess.Popen | None = None
    try:
        cluster.start_all(rollouts=2, ranks=1)
        cluster.wait_for(lambda: cluster.steps_recorded() >= 2, 120, "two steps")
        trainer = cluster.procs["trainer-0"]
        trainer.send_signal(signal.SIGSTOP)

        once = subprocess.run(
            _monitor_cmd(cluster, "mon-once", "--json", "--once"), capture_output=True, timeout=60, env=_env()
        )
        assert once.returncode == 0, once.stderr.decode()[-3000:]
        snap = json.loads(once.stdout.decode().strip().splitlines()[-1])
        assert snap["run"] == "mon"
        assert snap["trainer_version"] >= 1
        assert isinstance(snap["trainer_step"], int) and snap["trainer_step"] >= 2
        assert snap["max_staleness"] == cfg.staleness.max_staleness
        assert set(snap["workers"]) == {"rollout-0", "rollout-1"}
        for w in snap["workers"].values():
            assert isinstance(w["version"], int) and w["version"] >= 0
            assert isinstance(w["step"], int) and isinstance(w["lag"], int)
            assert w["lag"] == snap["trainer_step"] - w["step"] and 0 <= w["lag"] <= snap["trainer_step"]
            assert w["infra_errors"] == 0 and not w["engine_error"] and w["engine_load_failures"] == 0
            assert sum(w["end_reasons"].values()) == w["episodes"]
            if w["episodes"]:  # a worker may not have pulled a group yet in two steps (the other took them)
                # Single-turn arithmetic: one turn and one end reason per episode.
                assert w["turns_per_episode"] == 1.0
                assert 0 < w["length_mean"] <= cfg.rollout.sampling.max_new_tokens
        assert snap["rollout_episodes"]["episodes"] > 0
        assert snap["rollout_episodes"]["episodes"] == sum(w["episodes"] for w in snap["workers"].values())
        assert snap["engine_errors"] == []
        hist = snap["staleness_histogram"]
        assert set(hist) >= {str(k) for k in range(cfg.staleness.max_staleness + 1)}
        assert sum(hist.values()) >= 2 * cfg.trainer.groups_per_step
        assert snap["staleness_over_bound"] == 0
        queues = snap["queues"]
        assert isinstance(queues["prompts_waiting"], int) and isinstance(queues["trajectories_waiting"], int)
        # Admission keeps (max_staleness + 1) * groups_per_step groups ahead of the paused trainer.
        assert queues["prompts_waiting"] + queues["trajectories_waiting"] >= 1
        assert snap["dead_lettered"] == 0
        assert snap["discards"].keys() == {"dropped", "requeued", "duplicates"}
        assert snap["reward"]["trend"] and snap["last_step"]["step"] >= 1
        last = snap["last_step"]
        assert last["samples"] > 0 and last["infra_excluded"] == 0 and last["turns_mean"] == 1.0
        assert 0 < last["length_p50"] <= last["length_p90"] <= last["length_max"] <= cfg.rollout.sampling.max_new_tokens
        assert snap["lengths"]["last"]["p90"] == last["length_p90"] and snap["trained"]["samples"] > 0
        assert snap["rates"]["rollout_tokens_per_s"] >= 0 and snap["rates"]["trained_trajectories_per_s"] > 0
        assert "0" in snap["evals"]  # the pre-training eval, at step 0
        assert snap["eval_results"][0]["step"] == 0 and snap["eval_results"][0]["samples"] > 0

        live = subprocess.Popen(
            _monitor_cmd(cluster, "mon-prom", "--json", "--prometheus-port", "0"),
            stdout=subprocess.PIPE,
            stderr=open(cluster.run_dir / "mon-prom.log", "wb"),
            env=_env(),
        )
        port = json.loads(_read_line(live, 30))["prometheus_port"]
        assert isinstance(port, int) and port > 0
        text = _scrape(port, until='miles_worker_version{run="mon",worker="rollout-1"}')
        for name in METRIC_NAMES:
            assert f"\n{name}" in text, f"{name} missing from /metrics"
        assert 'miles_worker_lag{run="mon",worker="rollout-0"}' in text
        assert 'miles_worker_engine_error{run="mon",worker="rollout-0"} 0.0' in text
        assert 'miles_completion_length{run="mon",stat="p90"}' in text
        assert 'miles_eval_accuracy{run="mon",step="0"' in text
        assert "miles_staleness_bucket" in text
        live.terminate()
        assert live.wait(timeout=20) == 0
        trainer.send_signal(signal.SIGCONT)

        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 300, "the end of the run")
        cluster.wait_all_exit(60)
    finally:
        if live is not None and live.poll() is None:
            live.kill()
        cluster.procs["trainer-0"].send_signal(signal.SIGCONT)
        cluster.stop()
    for png in ("reward.png", "staleness.png", "lengths.png"):
        data = (cluster.run_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "plots_written" in cluster.log("controller")
    evals = [json.loads(line) for line in (cluster.run_dir / "evals.jsonl").read_text().splitlines()]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS  # before training and the final version
