"""Prometheus exposition of monitor snapshots, on a dedicated registry (no global client state).

A custom collector turns the latest snapshot into metric families at scrape time, so a worker
that left simply disappears from the next scrape. Every family has a ``run`` label.
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
    "miles_max_staleness",
    "miles_worker_version",
    "miles_worker_lag",
    "miles_staleness",
    "miles_prompts_waiting",
    "miles_trajectories_waiting",
    "miles_tokens_per_s",
    "miles_trajectories_per_s",
    "miles_reward_mean",
    "miles_trajectories_dropped_total",
    "miles_trajectories_requeued_total",
    "miles_dead_lettered",
    "miles_eval_accuracy",
)
# Served only once a controller heartbeat carrying the weight audit has arrived, so kept apart from
# METRIC_NAMES (what any scrape of a running run shows).
AUDIT_METRIC_NAMES = ("miles_weights_verified", "miles_weights_mismatches")


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
        run = snap["run"]

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            if value is not None:
                g = GaugeMetricFamily(name, doc, labels=["run"])
                g.add_metric([run], float(value))
                yield g

        yield from gauge("miles_trainer_version", "Newest policy version of the trainer.", snap["trainer_version"])
        yield from gauge("miles_max_staleness", "Configured staleness bound (eta).", snap["max_staleness"])
        version = GaugeMetricFamily(
            "miles_worker_version", "Policy version a rollout worker holds.", labels=["run", "worker"]
        )
        lag = GaugeMetricFamily(
            "miles_worker_lag", "Trainer version minus the worker's version.", labels=["run", "worker"]
        )
        wtok = GaugeMetricFamily("miles_worker_tokens_per_s", "Tokens generated per second.", labels=["run", "worker"])
        for wid, w in snap["workers"].items():
            version.add_metric([run, wid], float(w["version"]))
            if w["lag"] is not None:
                lag.add_metric([run, wid], float(w["lag"]))
            wtok.add_metric([run, wid], float(w["tokens_per_s"]))
        yield version
        yield lag
        yield wtok

        hist = snap["staleness_histogram"]
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for key, n in hist.items():
            cumulative += n
            buckets.append((str(float(key)), float(cumulative)))
        buckets.append(("+Inf", float(cumulative)))
        h = HistogramMetricFamily(
            "miles_staleness", "Staleness (versions) of trained trajectories, since the run began.", labels=["run"]
        )
        h.add_metric([run], buckets, sum_value=float(sum(int(k) * n for k, n in hist.items())))
        yield h

        q, r = snap["queues"], snap["rates"]
        yield from gauge("miles_prompts_waiting", "Prompt groups in the PROMPTS work queue.", q["prompts_waiting"])
        yield from gauge(
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
        yield from gauge("miles_reward_mean", "Mean reward of the last step.", snap["reward"]["last"])
        d = snap["discards"]
        for name, doc, value in (
            ("miles_trajectories_dropped", "Stale trajectories the trainer dropped.", d["dropped"]),
            ("miles_trajectories_requeued", "Stale trajectories the trainer sent back for re-issue.", d["requeued"]),
        ):
            c = CounterMetricFamily(name, doc, labels=["run"])
            c.add_metric([run], float(value))
            yield c
        yield from gauge("miles_dead_lettered", "Messages in the run's DLQ stream.", snap["dead_lettered"])
        weights = snap.get("weights") or {}
        yield from gauge(
            "miles_weights_verified",
            "Worker weight reports whose state digest matched the trainer's announcement (controller audit).",
            weights.get("verified"),
        )
        yield from gauge(
            "miles_weights_mismatches",
            "Worker weight reports whose state digest differs from the trainer's announcement (alert on > 0).",
            weights.get("mismatches"),
        )
        acc = GaugeMetricFamily(
            "miles_eval_accuracy", "Held-out accuracy per policy version.", labels=["run", "version"]
        )
        for version_key, a in snap["evals"].items():
            acc.add_metric([run, version_key], float(a))
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
