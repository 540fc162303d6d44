"""The monitor's snapshot model, fed with synthetic bus messages (no NATS, no clock)."""

from __future__ import annotations

import io
import json
import math
import re

import pytest
from rich.console import Console

from miles.bus.schema import EvalResult, Heartbeat, StepMetrics, TrainerDone, WeightsAnnounced
from miles.monitoring.prom import AUDIT_METRIC_NAMES, METRIC_NAMES, PrometheusExporter
from miles.monitoring.state import CounterRate, RunState, sparkline
from miles.monitoring.view import render

T0 = 1_000_000.0


def _hb(role: str, actor: str, version: int, ts: float, state: str = "running", **stats: float) -> Heartbeat:
    return Heartbeat(role=role, actor_id=actor, version=version, state=state, stats=stats, ts=ts)


def _announce(version: int, step: int) -> WeightsAnnounced:
    return WeightsAnnounced(version=version, step=step, digest="0" * 32, size=1, chunks=1)


# A worker's heartbeat totals after 10 multi-turn episodes (miles.actors.rollout_stats).
AGENT_STATS = {
    "groups": 2.0,
    "episodes": 10.0,
    "tokens": 900.0,
    "model_tokens": 400.0,
    "turns": 35.0,
    "tool_calls": 28.0,
    "parse_errors": 3.0,
    "env_s": 12.5,
    "infra_errors": 1.0,
    "reward_failed": 2.0,
    "truncated": 4.0,
    "template_mismatches": 1.0,
    "end_done": 6.0,
    "end_max_turns": 3.0,
    "end_infra_error": 1.0,
}
# A step's metrics (miles.training.batch.build_batch plus the trainer's).
AGENT_STEP = {
    "samples": 13.0,
    "episodes": 16.0,
    "infra_excluded": 2.0,
    "reward_failed": 1.0,
    "truncated": 3.0,
    "groups_without_signal": 1.0,
    "length_mean": 42.5,
    "length_p50": 40.0,
    "length_p90": 80.0,
    "length_max": 120.0,
    "turns_mean": 3.5,
    "tool_calls": 30.0,
    "parse_errors": 2.0,
    "env_s_mean": 1.25,
    "template_mismatches": 0.0,
    "tokens": 1500.0,
}


def _step(step: int, staleness: list[int], reward: float, **metrics: float) -> StepMetrics:
    return StepMetrics(
        step=step,
        policy_version=step + 1,
        metrics={"reward_mean": reward, "step_s": 2.0, "tokens_per_s": 50.0, **metrics},
        trained_group_ids=[f"g{step * 100 + i}" for i in range(len(staleness))],
        staleness=staleness,
    )


@pytest.fixture
def state() -> RunState:
    s = RunState(run="demo", max_staleness=2, rate_window_s=10.0, reward_points=3)
    for version in range(6):  # no restart yet: version v holds v steps
        s.on_weights(_announce(version, version))
    s.on_heartbeat(_hb("trainer", "trainer-0", 5, T0, dropped=2, requeued=7, duplicates=1))
    s.on_heartbeat(_hb("controller", "controller", 5, T0, issued=40, discarded=9))
    # w0 syncs every version, w1 is two behind; both count tokens at different speeds.
    for i in range(6):
        s.on_heartbeat(_hb("rollout", "w0", 5, T0 - 5 + i, tokens=100.0 * i, groups=1.0 * i))
        s.on_heartbeat(_hb("rollout", "w1", 3, T0 - 5 + i, tokens=20.0 * i, groups=0.5 * i))
    s.on_heartbeat(_hb("rollout", "w2", -1, T0))  # still loading its model
    return s


def test_versions_and_lags(state: RunState) -> None:
    snap = state.snapshot(T0 + 0.5)
    assert snap["trainer_version"] == 5
    assert snap["workers"]["w0"]["lag"] == 0
    assert snap["workers"]["w1"]["lag"] == 2
    assert snap["workers"]["w2"]["lag"] is None and snap["workers"]["w2"]["version"] == -1
    assert snap["worker_lag_max"] == 2
    assert snap["discards"] == {"dropped": 2, "requeued": 7, "duplicates": 1}
    assert snap["controller"] == {"issued": 40, "discarded": 9}
    # A step report newer than the last trainer heartbeat moves the trainer version on.
    state.on_step(_step(5, [0, 1], 0.5), T0 + 1)
    assert state.snapshot(T0 + 1)["trainer_version"] == 6
    assert state.snapshot(T0 + 1)["workers"]["w0"]["lag"] == 1


def test_worker_rates_from_heartbeat_counters(state: RunState) -> None:
    snap = state.snapshot(T0 + 0.5)
    assert snap["workers"]["w0"]["tokens_per_s"] == pytest.approx(100.0)
    assert snap["workers"]["w1"]["tokens_per_s"] == pytest.approx(20.0)
    assert snap["rates"]["rollout_tokens_per_s"] == pytest.approx(120.0)
    assert snap["rates"]["rollout_groups_per_s"] == pytest.approx(1.5)
    # Silent for longer than the window: no rate, and shown as not alive.
    later = state.snapshot(T0 + 60)
    assert later["rates"]["rollout_tokens_per_s"] == 0.0
    assert not later["workers"]["w0"]["alive"]
    assert later["worker_lag_max"] is None


def test_counter_rate_window_and_reset() -> None:
    rate = CounterRate(window_s=10.0)
    for t in range(30):
        rate.add(float(t), 3.0 * t)
    assert rate.rate(29.0) == pytest.approx(3.0)
    assert rate.samples[0][0] >= 18.0  # old samples fall out of the window
    rate.add(30.0, 5.0)  # the producer restarted: its counter went back
    assert rate.rate(30.0) == 0.0
    rate.add(31.0, 9.0)
    assert rate.rate(31.0) == pytest.approx(4.0)


def test_histogram_rates_reward_and_evals(state: RunState) -> None:
    state.on_step(_step(0, [0, 0, 1, 0], 0.2), T0)
    state.on_step(_step(1, [1, 2, 1, 0], 0.4), T0 + 2)
    state.on_step(_step(1, [1, 2, 1, 0], 0.4), T0 + 3)  # re-sent after a trainer restart: counted once
    state.on_step(_step(2, [3, 0, 0, 0], 0.6), T0 + 4)
    state.on_eval(EvalResult(policy_version=0, requested_version=0, accuracy=0.25, samples=40))
    state.on_eval(EvalResult(policy_version=2, requested_version=1, accuracy=0.3, samples=40, failed=1))
    snap = state.snapshot(T0 + 4)
    assert snap["staleness_histogram"] == {"0": 7, "1": 3, "2": 1, "3": 1}
    assert snap["staleness_over_bound"] == 1
    assert snap["staleness_mean"] == pytest.approx((3 + 2 + 3) / 12, abs=1e-3)
    assert snap["steps_seen"] == 3
    # 8 groups (steps 1 and 2) over the 4 s since step 0; 2 s * 50 tok/s = 100 tokens per step.
    assert snap["rates"]["trained_trajectories_per_s"] == pytest.approx(2.0)
    assert snap["rates"]["trained_tokens_per_s"] == pytest.approx(50.0)
    assert snap["reward"]["trend"] == [0.2, 0.4, 0.6]
    assert snap["reward"]["last"] == 0.6
    assert len(snap["reward"]["sparkline"]) == 3
    state.on_step(_step(3, [0], 0.8), T0 + 6)
    assert state.snapshot(T0 + 6)["reward"]["trend"] == [0.4, 0.6, 0.8]  # only the last reward_points
    assert snap["evals"] == {"0": 0.25, "1": 0.3}  # keyed by the steps trained into the requested version
    assert snap["eval_results"][1] == {
        "step": 1,
        "requested_version": 1,
        "policy_version": 2,
        "accuracy": 0.3,
        "samples": 40,
        "failed": 1,
    }
    assert snap["eval_accuracy"] == 0.3
    assert snap["last_step"]["step"] == 2 and snap["last_step"]["staleness_max"] == 3
    state.on_done(TrainerDone(policy_version=4, steps=4))
    assert state.snapshot(T0 + 7)["status"] == "done"


def test_empty_state_and_json(state: RunState) -> None:
    empty = RunState(run="x", max_staleness=1).snapshot(T0)
    assert empty["status"] == "waiting"
    assert empty["staleness_histogram"] == {"0": 0, "1": 0}
    assert empty["queues"] == {"prompts_waiting": None, "trajectories_waiting": None}
    state.set_queues(prompts_waiting=3, trajectories_waiting=5, dead_lettered=1)
    snap = json.loads(json.dumps(state.snapshot(T0)))
    assert snap["queues"] == {"prompts_waiting": 3, "trajectories_waiting": 5}
    assert snap["dead_lettered"] == 1


def test_sparkline() -> None:
    assert sparkline([]) == ""
    assert sparkline([0.0, 1.0]) == "▁█"
    assert len(set(sparkline([0.5, 0.5, 0.5]))) == 1


def test_view_renders_every_section(state: RunState) -> None:
    state.on_step(_step(0, [0, 1, 3], 0.2), T0)
    state.set_queues(prompts_waiting=3, trajectories_waiting=5, dead_lettered=0)
    console = Console(width=140, record=True)
    console.print(render(state.snapshot(T0 + 1)))
    text = console.export_text()
    for needle in ("trainer version 5", "w1", "staleness of trained trajectories", "prompts waiting", "reward"):
        assert needle in text
    console.print(render(RunState(run="x", max_staleness=1).snapshot(T0)))  # nothing known yet


def test_prometheus_collector(state: RunState) -> None:
    from prometheus_client import generate_latest

    exporter = PrometheusExporter()
    assert generate_latest(exporter.registry) == b""  # nothing before the first snapshot
    state.on_step(_step(0, [0, 1, 1], 0.2, **AGENT_STEP), T0)
    state.on_eval(EvalResult(policy_version=0, requested_version=0, accuracy=0.25, samples=40))
    state.on_heartbeat(_hb("rollout", "w0", 5, T0, **AGENT_STATS))
    state.on_heartbeat(_hb("rollout", "w3", 4, T0, state="engine_error", engine_error=1.0, engine_load_failures=2.0))
    state.set_queues(prompts_waiting=3, trajectories_waiting=5, dead_lettered=2)
    exporter.update(state.snapshot(T0 + 0.5))
    text = generate_latest(exporter.registry).decode()
    for name in METRIC_NAMES:
        assert name in text, name
    assert 'miles_worker_lag{run="demo",worker="w1"} 2.0' in text
    assert 'miles_trainer_step{run="demo"} 5.0' in text
    assert 'miles_worker_engine_error{run="demo",worker="w3"} 1.0' in text
    assert 'miles_worker_engine_error{run="demo",worker="w0"} 0.0' in text
    assert 'miles_worker_engine_load_failures_total{run="demo",worker="w3"} 2.0' in text
    assert 'miles_worker_turns_per_episode{run="demo",worker="w0"} 3.5' in text
    assert 'miles_worker_parse_errors_total{run="demo",worker="w0"} 3.0' in text
    assert 'miles_worker_env_seconds_per_episode{run="demo",worker="w0"} 1.25' in text
    assert 'miles_worker_episodes_ended_total{reason="max_turns",run="demo",worker="w0"} 3.0' in text
    assert 'miles_completion_length{run="demo",stat="p90"} 80.0' in text
    assert 'miles_step_infra_excluded{run="demo"} 2.0' in text
    assert 'miles_trained_episodes_total{outcome="reward_failed",run="demo"} 1.0' in text
    assert 'miles_eval_accuracy{run="demo",step="0",version="0"} 0.25' in text
    assert 'miles_staleness_bucket{le="1.0",run="demo"} 3.0' in text
    assert 'miles_staleness_count{run="demo"} 3.0' in text
    assert 'miles_trajectories_requeued_total{run="demo"} 7.0' in text
    assert 'miles_prompts_waiting{run="demo"} 3.0' in text


def test_weight_audit_from_controller_heartbeat(state: RunState) -> None:
    """The controller's audit counters reach the snapshot, the view (a mismatch in red) and Prometheus."""
    from prometheus_client import generate_latest

    assert RunState(run="x", max_staleness=1).snapshot(T0)["weights"] is None  # no controller yet
    old = RunState(run="x", max_staleness=1)
    old.on_heartbeat(_hb("controller", "controller", 0, T0, issued=1))  # a controller without the audit
    assert old.snapshot(T0)["weights"] == {"verified": None, "mismatches": None, "unverifiable": None, "pending": None}

    stats = {"issued": 40.0, "weights_verified": 12.0, "weights_mismatches": 0.0, "weights_unverifiable": 1.0}
    state.on_heartbeat(_hb("controller", "controller", 5, T0 + 1, weights_pending=2.0, **stats))
    snap = state.snapshot(T0 + 1)
    assert snap["weights"] == {"verified": 12, "mismatches": 0, "unverifiable": 1, "pending": 2}
    console = Console(width=140, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "held weights verified / mismatched" in text and "12 / 0" in text
    assert "WEIGHT MISMATCH" not in text

    state.on_heartbeat(
        _hb("controller", "controller", 5, T0 + 2, weights_pending=0.0, **{**stats, "weights_mismatches": 3.0})
    )
    snap = state.snapshot(T0 + 2)
    assert snap["weights"]["mismatches"] == 3
    console = Console(width=140, record=True)
    console.print(render(snap))
    assert "WEIGHT MISMATCH x3" in console.export_text()

    exporter = PrometheusExporter()
    exporter.update(snap)
    text = generate_latest(exporter.registry).decode()
    assert 'miles_weights_verified{run="demo"} 12.0' in text
    assert 'miles_weights_mismatches{run="demo"} 3.0' in text
    for name in AUDIT_METRIC_NAMES:
        assert name in text
    exporter.update(RunState(run="x", max_staleness=1).snapshot(T0))  # no controller: no audit gauges
    assert "miles_weights" not in generate_latest(exporter.registry).decode()


def test_lags_are_steps_across_a_trainer_restart() -> None:
    """Versions jump after a restart from a checkpoint; lags follow the announcements' steps, not the ids."""
    s = RunState(run="r", max_staleness=2)
    for version in range(6):
        s.on_weights(_announce(version, version))
    # The trainer restarts from its step-3 checkpoint: versions 4 and 5 are superseded by 6 and 7.
    s.on_weights(_announce(6, 4))
    s.on_weights(_announce(7, 5))
    for wid, version in (("head", 7), ("old", 3), ("superseded", 4), ("other", 6), ("unknown", 99)):
        s.on_heartbeat(_hb("rollout", wid, version, T0))
    snap = s.snapshot(T0)
    assert snap["trainer_version"] == 99  # a worker's version is a lower bound of the trainer's ...
    s.workers.pop("unknown")
    snap = s.snapshot(T0)
    assert (snap["trainer_version"], snap["trainer_step"]) == (7, 5)
    lags = {wid: (w["step"], w["lag"]) for wid, w in snap["workers"].items()}
    # Version differences would say 4, 3 and 1.
    assert lags == {"head": (5, 0), "old": (3, 2), "superseded": (4, 1), "other": (4, 1)}
    assert snap["worker_lag_max"] == 2
    s.on_heartbeat(_hb("rollout", "new", 42, T0))  # a version whose announcement is not in yet
    assert s.snapshot(T0)["workers"]["new"]["lag"] is None


def test_steps_from_heartbeats_and_reports_without_announcements() -> None:
    """Trainer and controller heartbeats and step reports pair versions with steps too."""
    s = RunState(run="r", max_staleness=1)
    assert s.snapshot(T0)["trainer_step"] is None
    s.on_heartbeat(_hb("controller", "controller", 10, T0, trainer_step=4.0))
    s.on_heartbeat(_hb("rollout", "w", 10, T0))
    assert s.snapshot(T0)["trainer_step"] == 4 and s.snapshot(T0)["workers"]["w"]["lag"] == 0
    s.on_step(StepMetrics(step=4, policy_version=11, metrics={}, trained_group_ids=[], staleness=[]), T0)
    assert s.snapshot(T0)["trainer_step"] == 5 and s.snapshot(T0)["workers"]["w"]["lag"] == 1
    s.on_heartbeat(_hb("trainer", "trainer-0", 12, T0, step=6.0))
    assert s.snapshot(T0)["workers"]["w"]["lag"] == 2
    s.on_done(TrainerDone(policy_version=13, steps=7))
    assert s.snapshot(T0)["trainer_step"] == 7


def test_eval_step_resolved_when_its_announcement_arrives() -> None:
    s = RunState(run="r", max_staleness=1)
    s.on_eval(EvalResult(policy_version=9, requested_version=8, accuracy=0.5, samples=10))
    snap = s.snapshot(T0)
    assert snap["evals"] == {} and snap["eval_results"][0]["step"] is None and snap["eval_accuracy"] is None
    s.on_weights(_announce(8, 3))
    s.on_eval(EvalResult(policy_version=9, requested_version=8, accuracy=0.5, samples=10))  # a duplicate
    snap = s.snapshot(T0)
    assert snap["evals"] == {"3": 0.5} and len(snap["eval_results"]) == 1 and snap["eval_accuracy"] == 0.5


def test_worker_episode_stats_and_engine_flags(state: RunState) -> None:
    state.on_heartbeat(_hb("rollout", "w0", 5, T0 + 0.1, **AGENT_STATS))
    state.on_heartbeat(_hb("rollout", "w1", 3, T0 + 0.1, state="engine_error", engine_error=1.0, **AGENT_STATS))
    state.on_heartbeat(_hb("rollout", "w2", 5, T0 + 0.1, engine_load_failures=3.0, engine_error=0.0))
    snap = state.snapshot(T0 + 0.5)
    w0 = snap["workers"]["w0"]
    assert w0["episodes"] == 10 and w0["turns_per_episode"] == 3.5 and w0["tool_calls"] == 28
    assert w0["parse_errors"] == 3 and w0["env_s_per_episode"] == 1.25 and w0["infra_errors"] == 1
    assert w0["reward_failed"] == 2 and w0["truncated"] == 4 and w0["length_mean"] == 40.0
    assert w0["template_mismatches"] == 1
    assert w0["end_reasons"] == {"done": 6, "max_turns": 3, "infra_error": 1}
    assert not w0["engine_error"] and w0["engine_load_failures"] == 0
    assert snap["workers"]["w1"]["engine_error"] and snap["workers"]["w2"]["engine_load_failures"] == 3
    assert snap["workers"]["w2"]["turns_per_episode"] is None  # no episode yet
    assert snap["engine_errors"] == ["w1"] and snap["engine_load_failures"] == 3
    total = snap["rollout_episodes"]
    assert total["episodes"] == 20 and total["turns_per_episode"] == 3.5 and total["parse_errors"] == 6
    assert total["end_reasons"] == {"done": 12, "max_turns": 6, "infra_error": 2}

    console = Console(width=160, record=True)
    console.print(render(snap))
    text = console.export_text()
    for needle in ("ENGINE ERROR: w1", "weight loads failed x3", "episodes by worker", "done:6", "3.50", "1.25"):
        assert needle in text, needle
    ansi = io.StringIO()
    Console(width=160, file=ansi, force_terminal=True, color_system="standard").print(render(snap))
    for flagged in ("ENGINE ERROR: w1", "weight loads failed x3", "engine_error"):
        assert re.search(re.escape("\x1b[1;31m") + r"\s*" + flagged, ansi.getvalue()), f"{flagged} is not bold red"


def test_step_lengths_totals_and_strict_json(state: RunState) -> None:
    state.on_step(_step(0, [0, 0], 0.2, **AGENT_STEP), T0)
    state.on_step(_step(1, [0, 1], 0.4, **{**AGENT_STEP, "length_max": 200.0, "grad_norm": math.nan}), T0 + 1)
    snap = state.snapshot(T0 + 2)
    assert snap["last_step"]["length_p90"] == 80.0 and snap["last_step"]["turns_mean"] == 3.5
    assert snap["last_step"]["grad_norm"] is None  # a skipped step's non-finite norm: strict JSON
    json.dumps(snap, allow_nan=False)
    assert snap["lengths"]["last"] == {"mean": 42.5, "p50": 40.0, "p90": 80.0, "max": 200.0}
    assert [p["step"] for p in snap["lengths"]["trend"]] == [0, 1] and len(snap["lengths"]["sparkline"]) == 2
    assert snap["trained"]["samples"] == 26 and snap["trained"]["infra_excluded"] == 4
    assert snap["trained"]["reward_failed"] == 2 and snap["trained"]["truncated"] == 6
    assert snap["trained"]["groups_without_signal"] == 2 and snap["trained"]["tool_calls"] == 60
    state.on_step(_step(1, [0, 1], 0.4, **AGENT_STEP), T0 + 3)  # re-sent: not counted twice
    assert state.snapshot(T0 + 3)["trained"]["samples"] == 26

    console = Console(width=160, record=True)
    console.print(render(snap))
    text = console.export_text()
    for needle in ("trained episodes", "infra-excluded", "42 / 40 / 80 / 200", "26 / 32", "length mean"):
        assert needle in text, needle


def test_version_steps_keep_the_newest() -> None:
    from miles.training.lineage import VersionSteps

    versions = VersionSteps(keep=3)
    assert versions.newest() is None
    versions.learn(-1, 0)  # 'no version yet' is not a version
    for version in (5, 1, 9, 7):
        versions.learn(version, version // 2)
    assert len(versions) == 3 and versions.step_of(1) is None and versions.newest() == (9, 4)


def test_a_supervised_inference_server_down_or_restarted_shows_in_the_monitor(state: RunState) -> None:
    state.on_heartbeat(_hb("rollout", "w0", 5, T0 + 0.1, engine_server_up=1.0, engine_restarts=2.0))
    state.on_heartbeat(_hb("rollout", "w1", 5, T0 + 0.1, engine_server_up=0.0, engine_restarts=1.0))
    state.on_heartbeat(_hb("rollout", "w2", 5, T0 + 0.1))  # the torch engine: no server to report
    snap = state.snapshot(T0 + 0.5)
    assert snap["engine_servers_down"] == ["w1"] and snap["engine_restarts"] == 3
    assert not snap["workers"]["w2"]["engine_server_down"] and snap["workers"]["w0"]["engine_restarts"] == 2
    console = Console(width=160, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "INFERENCE SERVER DOWN: w1" in text and "inference server restarts x3" in text
