"""Prometheus exposition of monitor snapshots, on a dedicated registry (no global client state).

A custom collector turns the latest snapshot into metric families at scrape time, so a worker
that left simply disappears from the next scrape. Every family has a ``run`` label; per-worker
ones a ``worker`` label. Lags and staleness are in lineage steps. Alert on
``miles_worker_engine_error > 0``, ``increase(miles_worker_engine_load_failures_total[5m]) > 0``
and ``miles_weights_mismatches > 0``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

METRIC_NAMES = (
    "miles_trainer_version",
    "miles_trainer_step",
    "miles_max_staleness",
    "miles_worker_version",
    "miles_worker_lag",
    "miles_worker_engine_error",
    "miles_worker_engine_load_failures_total",
    "miles_worker_episodes_total",
    "miles_worker_turns_per_episode",
    "miles_worker_tool_calls_total",
    "miles_worker_parse_errors_total",
    "miles_worker_env_seconds_per_episode",
    "miles_worker_infra_errors_total",
    "miles_worker_reward_failed_total",
    "miles_worker_truncated_total",
    "miles_worker_completion_tokens_mean",
    "miles_worker_episodes_ended_total",
    "miles_staleness",
    "miles_prompts_waiting",
    "miles_trajectories_waiting",
    "miles_tokens_per_s",
    "miles_trajectories_per_s",
    "miles_reward_mean",
    "miles_step_turns_mean",
    "miles_step_tool_calls",
    "miles_step_parse_errors",
    "miles_step_env_seconds_mean",
    "miles_step_infra_excluded",
    "miles_step_reward_failed",
    "miles_step_truncated",
    "miles_completion_length",
    "miles_trained_episodes_total",
    "miles_trajectories_dropped_total",
    "miles_trajectories_requeued_total",
    "miles_dead_lettered",
    "miles_eval_accuracy",
)
# Served only once a controller heartbeat carrying the weight audit has arrived, so kept apart from
# METRIC_NAMES (what any scrape of a running run shows).
AUDIT_METRIC_NAMES = ("miles_weights_verified", "miles_weights_mismatches")

# (family suffix, snapshot key, help, counter?) of the per-worker episode figures (heartbeat totals).
WORKER_EPISODE_FAMILIES = (
    ("episodes", "episodes", "Episodes the worker played (since it started).", True),
    ("turns_per_episode", "turns_per_episode", "Model turns per episode.", False),
    ("tool_calls", "tool_calls", "Tool calls the worker's episodes made.", True),
    ("parse_errors", "parse_errors", "Model turns whose tool call could not be parsed.", True),
    ("env_seconds_per_episode", "env_s_per_episode", "Seconds per episode spent in the environment.", False),
    ("infra_errors", "infra_errors", "Episodes the sandbox or verifier broke (excluded from training).", True),
    ("reward_failed", "reward_failed", "Episodes whose reward raised or was not finite.", True),
    ("truncated", "truncated", "Episodes whose last model turn hit max_new_tokens.", True),
    ("completion_tokens_mean", "length_mean", "Model tokens per episode.", False),
)
# (family, step metric, help) of the last step's episode figures.
STEP_FAMILIES = (
    ("miles_step_turns_mean", "turns_mean", "Model turns per trained episode in the last step."),
    ("miles_step_tool_calls", "tool_calls", "Tool calls of the last step's episodes."),
    ("miles_step_parse_errors", "parse_errors", "Unparseable tool calls in the last step's episodes."),
    ("miles_step_env_seconds_mean", "env_s_mean", "Environment seconds per episode in the last step."),
    ("miles_step_infra_excluded", "infra_excluded", "Episodes of the last step excluded for infrastructure errors."),
    ("miles_step_reward_failed", "reward_failed", "Episodes of the last step whose reward failed."),
    ("miles_step_truncated", "truncated", "Episodes of the last step truncated at max_new_tokens."),
)


class SnapshotCollector(Collector):
    """Yields the metric families of the last snapshot handed to :meth:`update`."""

    def __init__(self) -> None:
        self._snap: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def update(self, snap: dict[str, Any]) -> None:
        with self._lock:
            self._snap = snap

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snap = self._snap
        if snap is None:
            return
        yield from _run_families(snap)
        yield from _worker_families(snap)
        yield from _staleness_family(snap)
        yield from _flow_families(snap)
        yield from _step_families(snap)
        yield from _eval_family(snap)


def _gauge(run: str, name: str, doc: str, value: float | None) -> Iterator[Metric]:
    """One ``run``-labelled gauge; nothing while the value is unknown."""
    if value is not None:
        g = GaugeMetricFamily(name, doc, labels=["run"])
        g.add_metric([run], float(value))
        yield g


def _counter(run: str, name: str, doc: str, value: float) -> Metric:
    c = CounterMetricFamily(name, doc, labels=["run"])
    c.add_metric([run], float(value))
    return c


def _run_families(snap: dict[str, Any]) -> Iterator[Metric]:
    run = snap["run"]
    yield from _gauge(run, "miles_trainer_version", "Newest policy version of the trainer.", snap["trainer_version"])
    yield from _gauge(
        run, "miles_trainer_step", "Lineage step (batches trained) of the newest version.", snap["trainer_step"]
    )
    yield from _gauge(run, "miles_max_staleness", "Configured staleness bound (eta), in steps.", snap["max_staleness"])


def _worker_families(snap: dict[str, Any]) -> Iterator[Metric]:
    run, workers = snap["run"], snap["workers"]
    labels = ["run", "worker"]
    version = GaugeMetricFamily("miles_worker_version", "Policy version a rollout worker holds.", labels=labels)
    lag = GaugeMetricFamily(
        "miles_worker_lag", "Steps between the trainer's newest version and the worker's.", labels=labels
    )
    wtok = GaugeMetricFamily("miles_worker_tokens_per_s", "Tokens generated per second.", labels=labels)
    error = GaugeMetricFamily(
        "miles_worker_engine_error", "1 while the worker's engine is dead (alert on > 0).", labels=labels
    )
    loads = CounterMetricFamily(
        "miles_worker_engine_load_failures", "Weight loads the engine (SGLang) refused.", labels=labels
    )
    ended = CounterMetricFamily(
        "miles_worker_episodes_ended", "Episodes by end reason.", labels=["run", "worker", "reason"]
    )
    episodes = {
        key: (CounterMetricFamily if counter else GaugeMetricFamily)(f"miles_worker_{suffix}", doc, labels=labels)
        for suffix, key, doc, counter in WORKER_EPISODE_FAMILIES
    }
    for wid, w in workers.items():
        version.add_metric([run, wid], float(w["version"]))
        if w["lag"] is not None:
            lag.add_metric([run, wid], float(w["lag"]))
        wtok.add_metric([run, wid], float(w["tokens_per_s"]))
        error.add_metric([run, wid], float(w["engine_error"]))
        loads.add_metric([run, wid], float(w["engine_load_failures"]))
        for key, family in episodes.items():
            if w[key] is not None:
                family.add_metric([run, wid], float(w[key]))
        for reason, n in w["end_reasons"].items():
            ended.add_metric([run, wid, reason], float(n))
    yield from (version, lag, wtok, error, loads, *episodes.values(), ended)


def _staleness_family(snap: dict[str, Any]) -> Iterator[Metric]:
    hist = snap["staleness_histogram"]
    buckets: list[tuple[str, float]] = []
    cumulative = 0
    for key, n in hist.items():
        cumulative += n
        buckets.append((str(float(key)), float(cumulative)))
    buckets.append(("+Inf", float(cumulative)))
    h = HistogramMetricFamily(
        "miles_staleness", "Staleness (steps) of trained trajectories, since the run began.", labels=["run"]
    )
    h.add_metric([snap["run"]], buckets, sum_value=float(sum(int(k) * n for k, n in hist.items())))
    yield h


def _flow_families(snap: dict[str, Any]) -> Iterator[Metric]:
    run, q, r = snap["run"], snap["queues"], snap["rates"]
    yield from _gauge(run, "miles_prompts_waiting", "Prompt groups in the PROMPTS work queue.", q["prompts_waiting"])
    yield from _gauge(
        run,
        "miles_trajectories_waiting",
        "Trajectories not yet consumed or acked by the trainer.",
        q["trajectories_waiting"],
    )
    tps = GaugeMetricFamily("miles_tokens_per_s", "Token throughput.", labels=["run", "source"])
    tps.add_metric([run, "rollout"], float(r["rollout_tokens_per_s"]))
    tps.add_metric([run, "trainer"], float(r["trained_tokens_per_s"]))
    yield tps
    traj = GaugeMetricFamily("miles_trajectories_per_s", "Trajectory (group) throughput.", labels=["run", "source"])
    traj.add_metric([run, "rollout"], float(r["rollout_groups_per_s"]))
    traj.add_metric([run, "trainer"], float(r["trained_trajectories_per_s"]))
    yield traj
    d = snap["discards"]
    yield _counter(run, "miles_trajectories_dropped", "Stale trajectories the trainer dropped.", d["dropped"])
    yield _counter(
        run, "miles_trajectories_requeued", "Stale trajectories the trainer sent back for re-issue.", d["requeued"]
    )
    yield from _gauge(run, "miles_dead_lettered", "Messages in the run's DLQ stream.", snap["dead_lettered"])
    weights = snap.get("weights") or {}
    yield from _gauge(
        run,
        "miles_weights_verified",
        "Worker weight reports whose state digest matched the trainer's announcement (controller audit).",
        weights.get("verified"),
    )
    yield from _gauge(
        run,
        "miles_weights_mismatches",
        "Worker weight reports whose state digest differs from the trainer's announcement (alert on > 0).",
        weights.get("mismatches"),
    )


def _step_families(snap: dict[str, Any]) -> Iterator[Metric]:
    """The last step's reward, episode figures and completion lengths, and episode totals over all steps."""
    run, step = snap["run"], snap["last_step"] or {}
    yield from _gauge(run, "miles_reward_mean", "Mean reward of the last step.", snap["reward"]["last"])
    for name, key, doc in STEP_FAMILIES:
        yield from _gauge(run, name, doc, step.get(key))
    length = GaugeMetricFamily(
        "miles_completion_length", "Model tokens of the last step's trained completions.", labels=["run", "stat"]
    )
    for stat, value in (snap["lengths"]["last"] or {}).items():
        length.add_metric([run, stat], float(value))
    yield length
    trained = snap["trained"]
    episodes = CounterMetricFamily(
        "miles_trained_episodes",
        "Episodes of every step seen, by outcome: trained, infra_excluded, reward_failed (truncated: "
        "cut at max_new_tokens, trained or not).",
        labels=["run", "outcome"],
    )
    for outcome, key in (
        ("trained", "samples"),
        ("infra_excluded", "infra_excluded"),
        ("reward_failed", "reward_failed"),
        ("truncated", "truncated"),
    ):
        episodes.add_metric([run, outcome], float(trained[key]))
    yield episodes


def _eval_family(snap: dict[str, Any]) -> Iterator[Metric]:
    run = snap["run"]
    acc = GaugeMetricFamily(
        "miles_eval_accuracy",
        "Held-out accuracy of the version trained for `step` batches.",
        labels=["run", "step", "version"],
    )
    seen: set[int] = set()
    for e in snap["eval_results"]:
        if e["step"] is not None and e["step"] not in seen:  # the first evaluation of a step, as in the record
            seen.add(e["step"])
            acc.add_metric([run, str(e["step"]), str(e["policy_version"])], float(e["accuracy"]))
    yield acc


class PrometheusExporter:
    """An HTTP /metrics endpoint serving :class:`SnapshotCollector` from its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve on ``port`` (0: any free port); returns the bound port."""
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = int(self._server.server_port)
        return self.port

    def update(self, snap: dict[str, Any]) -> None:
        self.collector.update(snap)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
