"""The run directory's record: metrics.jsonl, the group ledger, and summary.json.

Written by the controller only, from durable bus streams, so every line can be rebuilt by
replaying the METRICS and EVENTS streams.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from miles.bus.schema import EvalResult, StepMetrics


def _atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunRecord:
    """Appends step metrics and ledger lines; writes the summary at the end."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / "metrics.jsonl"
        self.ledger_path = run_dir / "groups.jsonl"
        self.summary_path = run_dir / "summary.json"
        started = run_dir / "started_at"
        if not started.exists():
            started.write_text(f"{time.time()}\n")
        self.started_at = float(started.read_text())
        self.evals: dict[int, float] = {}
        self.staleness: list[int] = []
        self.groups_trained = 0
        self.samples_trained = 0
        self.dropped = 0
        self.requeued = 0
        self.steps_seen: set[int] = set()

    def ledger(self, event: str, **fields: Any) -> None:
        """One line per group event: issued, trained, dropped, requeued (the accounting trail)."""
        with open(self.ledger_path, "a") as f:
            f.write(json.dumps({"event": event, "t": round(time.time(), 3), **fields}) + "\n")

    def count_discarded(self, n: int, requeue: bool) -> None:
        if requeue:
            self.requeued += n
        else:
            self.dropped += n

    def step(self, msg: StepMetrics, **extra: float) -> None:
        if msg.step in self.steps_seen:  # a redelivered metrics message after a controller restart
            return
        self.steps_seen.add(msg.step)
        self.staleness.extend(msg.staleness)
        self.groups_trained += len(msg.trained_group_ids)
        self.samples_trained += int(msg.metrics.get("samples", 0))
        for gid, lag in zip(msg.trained_group_ids, msg.staleness, strict=True):
            self.ledger("trained", group_id=gid, step=msg.step, staleness=lag)
        line = {
            "step": msg.step,
            "policy_version": msg.policy_version,
            "reward_mean": msg.metrics.get("reward_mean"),
            "staleness_mean": sum(msg.staleness) / len(msg.staleness) if msg.staleness else 0.0,
            "staleness_max": max(msg.staleness, default=0),
            "tokens_per_s": msg.metrics.get("tokens_per_s"),
            "step_s": msg.metrics.get("step_s"),
            **{k: v for k, v in msg.metrics.items() if k not in {"reward_mean", "tokens_per_s", "step_s"}},
            **extra,
            "time": round(time.time() - self.started_at, 3),
        }
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def eval(self, msg: EvalResult) -> None:
        self.evals[msg.policy_version] = msg.accuracy

    def write_summary(self, **fields: Any) -> dict[str, Any]:
        """summary.json: the record's own figures plus ``fields`` from the controller (group accounting,
        dead letters, worker versions, and the weight audit: ``weights_verified``, ``weights_mismatches``,
        ``weights_unverifiable``, ``weights_pending``, ``weights_last_verified``, ``weights_recent_mismatches``).
        The audit counters default to 0 so a reader can rely on them being present."""
        versions = sorted(self.evals)
        summary: dict[str, Any] = {
            "eval_before": self.evals.get(0),
            "eval_after": self.evals[versions[-1]] if versions else None,
            "eval_after_version": versions[-1] if versions else None,
            "wall_s": round(time.time() - self.started_at, 2),
            "staleness_mean": sum(self.staleness) / len(self.staleness) if self.staleness else 0.0,
            "staleness_max": max(self.staleness, default=0),
            "trajectories_trained": self.groups_trained,
            "samples_trained": self.samples_trained,
            "trajectories_dropped": self.dropped + self.requeued,
            "trajectories_requeued": self.requeued,
            "weights_verified": 0,
            "weights_mismatches": 0,
            **fields,
        }
        _atomic_write_json(self.summary_path, summary)
        return summary
