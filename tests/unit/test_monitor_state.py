"""The monitor's snapshot model, fed with synthetic bus messages (no NATS, no clock)."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from miles.bus.schema import EvalResult, Heartbeat, StepMetrics, TrainerDone
from miles.monitoring.prom import AUDIT_METRIC_NAMES, METRIC_NAMES, PrometheusExporter
from miles.monitoring.state import CounterRate, RunState, sparkline
from miles.monitoring.view import render

T0 = 1_000_000.0


def _hb(role: str, actor: str, version: int, ts: float, **stats: float) -> Heartbeat:
    return Heartbeat(role=role, actor_id=actor, version=version, stats=stats, ts=ts)


def _step(step: int, staleness: list[int], reward: float, **metrics: float) -> StepMetrics:
    return StepMetrics(
        step=step,
        policy_version=step + 1,
        metrics={"reward_mean": reward, "step_s": 2.0, "tokens_per_s": 50.0, **metrics},
        trained_group_ids=[f"g{step}-{i}" for i in range(len(staleness))],
        staleness=staleness,
    )


@pytest.fixture
def state() -> RunState:
    s = RunState(run="demo", max_staleness=2, rate_window_s=10.0, reward_points=3)
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
    state.on_step(_step(0, [0, 0, 1, 0], 0.2, eval_accuracy=0.3), T0)
    state.on_step(_step(1, [1, 2, 1, 0], 0.4), T0 + 2)
    state.on_step(_step(1, [1, 2, 1, 0], 0.4), T0 + 3)  # re-sent after a trainer restart: counted once
    state.on_step(_step(2, [3, 0, 0, 0], 0.6), T0 + 4)
    state.on_eval(EvalResult(policy_version=0, accuracy=0.25, samples=40))
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
    assert snap["evals"] == {"0": 0.25, "1": 0.3}
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
    state.on_step(_step(0, [0, 1, 1], 0.2), T0)
    state.on_eval(EvalResult(policy_version=0, accuracy=0.25, samples=40))
    state.set_queues(prompts_waiting=3, trajectories_waiting=5, dead_lettered=2)
    exporter.update(state.snapshot(T0 + 0.5))
    text = generate_latest(exporter.registry).decode()
    for name in METRIC_NAMES:
        assert name in text, name
    assert 'miles_worker_lag{run="demo",worker="w1"} 2.0' in text
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
