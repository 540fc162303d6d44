"""The monitor's model of a run: a pure state fed by bus messages, read as one plain-data snapshot.

No I/O here, no clock reads: every input carries its time (heartbeat ``ts``, the JetStream
timestamp of a metrics message, the ``now`` of a snapshot), so the whole model is unit-testable
with synthetic messages. :meth:`RunState.snapshot` is the ``--json`` document (fields listed in
:mod:`miles.actors.monitor`; strict JSON: a non-finite step metric is null) and the single input of
the rich view and the Prometheus exporter.

Lags are in lineage steps, never version differences: versions are unique ids that jump past a
trainer restart (:class:`~miles.training.lineage.VersionSteps`).

A monitor that starts late starts from the controller's newest snapshot (:meth:`RunState.start_from`): its
totals over the steps are the controller's own fold (:class:`~miles.actors.step_totals.StepTotals`), so it
shows the whole run even when the oldest step reports were purged, and a report it reads again counts once.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from miles.actors.step_totals import SUMMED, StepTotals
from miles.bus.schema import ControllerSnapshot, EvalResult, Heartbeat, StepMetrics, TrainerDone, WeightsAnnounced
from miles.monitoring.episodes import engine_flags, episode_summary, summed
from miles.training.audit import audit_alarm
from miles.training.lineage import VersionSteps

SPARK_CHARS = "▁▂▃▄▅▆▇█"
LENGTH_STATS = ("mean", "p50", "p90", "max")  # of the trained completions' model tokens, per step


def sparkline(values: list[float]) -> str:
    """Unicode block sparkline of ``values`` scaled to their own min..max."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARK_CHARS[len(SPARK_CHARS) // 2] * len(values)
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[round((v - lo) / (hi - lo) * top)] for v in values)


class CounterRate:
    """Rate of a monotone counter from timestamped samples within a sliding window.

    A counter that goes backwards (the producer restarted) starts a new history.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        if self.samples and (value < self.samples[-1][1] or t < self.samples[-1][0]):
            self.samples.clear()
        self.samples.append((t, value))
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.window_s:
            self.samples.popleft()

    def rate(self, now: float) -> float:
        """Increase per second over the window; 0 without two samples or when the last is older than the window."""
        if len(self.samples) < 2 or now - self.samples[-1][0] > self.window_s:
            return 0.0
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


@dataclass
class WorkerView:
    heartbeat: Heartbeat
    tokens: CounterRate
    groups: CounterRate


@dataclass
class RunState:
    """Everything the monitor knows about one run, updated message by message."""

    run: str
    max_staleness: int
    rate_window_s: float = 30.0
    reward_points: int = 40
    stale_after_s: float = 5.0  # an actor silent this long is shown as gone
    trainer: Heartbeat | None = None
    controller: Heartbeat | None = None
    workers: dict[str, WorkerView] = field(default_factory=dict)
    totals: StepTotals = field(default_factory=StepTotals)
    last_step: StepMetrics | None = None
    last_step_t: float | None = None
    rewards: dict[int, float] = field(default_factory=dict)  # step -> reward mean, the newest reward_points steps
    lengths: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> LENGTH_STATS, the same steps
    eval_results: dict[tuple[str, int, int], EvalResult] = field(default_factory=dict)
    eval_steps: dict[int, int | None] = field(default_factory=dict)  # evaluated version -> its step (None: unknown)
    versions: VersionSteps = field(default_factory=VersionSteps)
    done: TrainerDone | None = None
    prompts_waiting: int | None = None
    trajectories_waiting: int | None = None
    dead_lettered: int | None = None
    refusals: dict[str, dict[str, float]] = field(default_factory=dict)  # actor -> its refusal counters
    unverified: int = 0  # messages this monitor skipped: no valid signature where the run signs
    trained_groups: CounterRate = field(init=False)
    trained_tokens: CounterRate = field(init=False)
    _tokens_total: float = 0.0

    def __post_init__(self) -> None:
        self.trained_groups = CounterRate(self.rate_window_s)
        self.trained_tokens = CounterRate(self.rate_window_s)

    def _refused(self) -> dict[str, Any]:
        """What the actors refused (from their heartbeats), and the alarms to show in red."""
        by_category: dict[str, int] = {}
        for counts in self.refusals.values():
            for key, value in counts.items():
                if key.startswith("refused_"):
                    name = key[len("refused_") :]
                    by_category[name] = by_category.get(name, 0) + int(value)
        alarms = []
        unsigned = by_category.get("unsigned", 0) + self.unverified
        if unsigned:
            alarms.append(f"{unsigned} messages without a valid signature refused (forged or altered)")
        audit = self._weights_audit()
        if audit is not None and audit["mismatches"]:
            alarms.append(f"{audit['mismatches']} held-weight reports did not match the announced weights")
        if self.trainer is not None and (alarm := audit_alarm(self.trainer.stats)):
            alarms.append(alarm)
        return {
            "refused": dict(sorted(by_category.items())),
            "refused_total": sum(int(c.get("dead_lettered", 0)) for c in self.refusals.values()),
            "alarms": alarms,
        }

    # ------------------------------------------------------------------ inputs

    def start_from(self, snapshot: ControllerSnapshot) -> None:
        """Take the controller's snapshot as the run so far: its step totals, its version map, its evaluations.
        Step reports read afterwards count only if the snapshot had not counted their step."""
        self.totals = StepTotals.from_part(snapshot.record.steps)
        for version, step in snapshot.version_steps:
            self._learn(version, step)
        for step, _accuracy, _length, version in snapshot.record.evals:
            if version >= 0:
                self.eval_steps[version] = step
        for part in snapshot.evaluations:
            if part.result is not None:
                self.on_eval(part.result)

    def _learn(self, version: int, step: int) -> None:
        """A version's step; an evaluation of it keeps the step after the version map has forgotten it."""
        self.versions.learn(version, step)
        if version in self.eval_steps and self.eval_steps[version] is None:
            self.eval_steps[version] = step

    def on_heartbeat(self, hb: Heartbeat) -> None:
        counts = {k: v for k, v in hb.stats.items() if k == "dead_lettered" or k.startswith("refused_")}
        if counts:
            self.refusals[hb.actor_id] = counts
        if hb.role == "trainer":
            if self.trainer is None or hb.ts >= self.trainer.ts:
                self.trainer = hb
            if "step" in hb.stats:
                self._learn(hb.version, int(hb.stats["step"]))
        elif hb.role == "controller":
            self.controller = hb
            if "trainer_step" in hb.stats:
                self._learn(hb.version, int(hb.stats["trainer_step"]))
        elif hb.role == "rollout":
            view = self.workers.get(hb.actor_id)
            if view is None:
                view = self.workers[hb.actor_id] = WorkerView(
                    hb, CounterRate(self.rate_window_s), CounterRate(self.rate_window_s)
                )
            view.heartbeat = hb
            view.tokens.add(hb.ts, hb.stats.get("tokens", 0.0))
            view.groups.add(hb.ts, hb.stats.get("groups", 0.0))

    def on_step(self, msg: StepMetrics, t: float) -> None:
        """A step report; ``t`` is when it was published (JetStream timestamp). A step counts once in the totals
        (re-sent after a trainer restart, or counted by the snapshot the monitor started from); the trends and
        the last step show its newest report."""
        self._learn(msg.policy_version, msg.step + 1)  # a replayed step's new version too
        if self.last_step is None or msg.step >= self.last_step.step:
            self.last_step, self.last_step_t = msg, t
        if "reward_mean" in msg.metrics:
            self.rewards[msg.step] = msg.metrics["reward_mean"]
            _keep_newest(self.rewards, self.reward_points)
        if "length_mean" in msg.metrics:
            self.lengths[msg.step] = {k: msg.metrics.get(f"length_{k}", 0.0) for k in LENGTH_STATS}
            _keep_newest(self.lengths, self.reward_points)
        if not self.totals.add(msg):
            return
        self._tokens_total += msg.metrics.get("tokens_per_s", 0.0) * msg.metrics.get("step_s", 0.0)
        self.trained_groups.add(t, self.totals.groups)
        self.trained_tokens.add(t, self._tokens_total)

    def on_eval(self, msg: EvalResult) -> None:
        """An evaluation; its step may be learnt later (its version's announcement can come after it)."""
        self.eval_results.setdefault((msg.eval_id, msg.requested_version, msg.policy_version), msg)
        version = _eval_version(msg)
        if self.eval_steps.get(version) is None:
            self.eval_steps[version] = self.versions.step_of(version)

    def on_weights(self, msg: WeightsAnnounced) -> None:
        self._learn(msg.version, msg.step)

    def on_done(self, msg: TrainerDone) -> None:
        self.done = msg
        self._learn(msg.policy_version, msg.steps)

    def absorb(self, message: Any, t: float) -> None:
        """Route any decoded bus message (others are ignored)."""
        if isinstance(message, Heartbeat):
            self.on_heartbeat(message)
        elif isinstance(message, StepMetrics):
            self.on_step(message, t)
        elif isinstance(message, EvalResult):
            self.on_eval(message)
        elif isinstance(message, TrainerDone):
            self.on_done(message)
        elif isinstance(message, WeightsAnnounced):
            self.on_weights(message)

    def set_queues(self, *, prompts_waiting: int, trajectories_waiting: int, dead_lettered: int) -> None:
        self.prompts_waiting = prompts_waiting
        self.trajectories_waiting = trajectories_waiting
        self.dead_lettered = dead_lettered

    # ------------------------------------------------------------------ outputs

    def trainer_version(self) -> int:
        candidates = [0]
        if self.trainer is not None:
            candidates.append(self.trainer.version)
        if self.last_step is not None:
            candidates.append(self.last_step.policy_version)
        if self.done is not None:
            candidates.append(self.done.policy_version)
        newest = self.versions.newest()
        if newest is not None:
            candidates.append(newest[0])
        # A worker can only hold published weights: its version is a lower bound too (the trainer's own
        # heartbeat and step report can trail its weight announcement by a moment).
        candidates.extend(view.heartbeat.version for view in self.workers.values())
        return max(candidates)

    def trainer_step(self) -> int | None:
        """Lineage step of the trainer's newest version (None before any version is paired with its step)."""
        step = self.versions.step_of(self.trainer_version())
        if step is not None:
            return step
        newest = self.versions.newest()
        return newest[1] if newest is not None else None

    def _worker_lag(self, version: int, trainer_step: int | None) -> tuple[int | None, int | None]:
        """``(step, lag)`` of a worker holding ``version``; lag in steps, None when either step is unknown.

        A worker still on a version superseded by a trainer restart can be 'ahead' of the new lineage: 0, not < 0.
        """
        step = self.versions.step_of(version) if version >= 0 else None
        if step is None or trainer_step is None:
            return step, None
        return step, max(0, trainer_step - step)

    def _evals(self) -> list[dict[str, Any]]:
        """Every evaluation with the lineage step of the version it was requested for, oldest step first."""
        out = []
        for msg in self.eval_results.values():
            out.append(
                {
                    "step": self.eval_steps.get(_eval_version(msg)),
                    "requested_version": msg.requested_version,
                    "policy_version": msg.policy_version,
                    "accuracy": msg.accuracy,
                    "samples": msg.samples,
                    "failed": msg.failed,
                }
            )
        return sorted(out, key=lambda e: (e["step"] is None, e["step"] or 0))  # stable: arrival order within a step

    def _lengths(self) -> dict[str, Any]:
        points = sorted(self.lengths.items())
        means = [point["mean"] for _, point in points]
        return {
            "last": {k: round(v, 2) for k, v in points[-1][1].items()} if points else None,
            "trend": [{"step": step, **{k: round(v, 2) for k, v in point.items()}} for step, point in points],
            "sparkline": sparkline(means),
        }

    def _weights_audit(self) -> dict[str, int | None] | None:
        """The controller's audit of held vs announced weights (None before its first heartbeat)."""
        if self.controller is None:
            return None
        stats = self.controller.stats

        def count(key: str) -> int | None:
            return int(stats[key]) if key in stats else None  # None: a controller without the audit

        return {
            "verified": count("weights_verified"),
            "mismatches": count("weights_mismatches"),
            "unverifiable": count("weights_unverifiable"),
            "pending": count("weights_pending"),
        }

    def snapshot(self, now: float) -> dict[str, Any]:
        """Plain-data view of the run at ``now`` (unix s): the ``--json`` document."""
        v = self.trainer_version()
        tstep = self.trainer_step()
        workers: dict[str, Any] = {}
        for wid, view in sorted(self.workers.items()):
            hb = view.heartbeat
            wstep, lag = self._worker_lag(hb.version, tstep)
            workers[wid] = {
                "version": hb.version,
                "step": wstep,
                "lag": lag,
                "state": hb.state,
                "age_s": round(now - hb.ts, 2),
                "alive": now - hb.ts <= self.stale_after_s,
                "groups": int(hb.stats.get("groups", 0)),
                "tokens": int(hb.stats.get("tokens", 0)),
                "tokens_per_s": round(view.tokens.rate(now), 2),
                "groups_per_s": round(view.groups.rate(now), 3),
                "syncs": int(hb.stats.get("syncs", 0)),
                "checksum_failures": int(hb.stats.get("checksum_failures", 0)),
                "last_pause_ms": round(hb.stats.get("last_pause_ms", 0.0), 1),
                **engine_flags(hb.state, hb.stats),
                **episode_summary(hb.stats),
            }
        lags = [w["lag"] for w in workers.values() if w["lag"] is not None and w["alive"]]
        tstats = self.trainer.stats if self.trainer is not None else {}
        step = self.last_step
        last_step = None
        if step is not None:
            last_step = {
                "step": step.step,
                "policy_version": step.policy_version,
                "age_s": round(now - self.last_step_t, 2) if self.last_step_t is not None else None,
                "staleness_mean": round(sum(step.staleness) / len(step.staleness), 3) if step.staleness else 0.0,
                "staleness_max": max(step.staleness, default=0),
                **{k: round(val, 6) if math.isfinite(val) else None for k, val in step.metrics.items()},
            }
        staleness = self.totals.staleness
        hist_top = max([self.max_staleness, *staleness])
        histogram = {str(k): staleness.get(k, 0) for k in range(hist_top + 1)}
        rewards = [r for _, r in sorted(self.rewards.items())]
        eval_results = self._evals()
        evals = {e["step"]: e["accuracy"] for e in reversed(eval_results) if e["step"] is not None}  # first wins
        evals = dict(sorted(evals.items()))
        rollout = episode_summary(summed(view.heartbeat.stats for view in self.workers.values()))
        return {
            "run": self.run,
            "time": round(now, 3),
            "status": "done" if self.done is not None else ("running" if self.trainer or self.workers else "waiting"),
            "trainer_version": v,
            "trainer_step": tstep,
            "trainer_alive": self.trainer is not None and now - self.trainer.ts <= self.stale_after_s,
            "max_staleness": self.max_staleness,
            "steps_seen": len(self.totals.steps),
            "workers": workers,
            "worker_lag_max": max(lags, default=None),
            "staleness_histogram": histogram,
            "staleness_mean": round(self.totals.staleness_mean, 4) if staleness else None,
            "staleness_over_bound": sum(n for k, n in staleness.items() if k > self.max_staleness),
            "queues": {
                "prompts_waiting": self.prompts_waiting,
                "trajectories_waiting": self.trajectories_waiting,
            },
            "rates": {
                "window_s": self.rate_window_s,
                "rollout_tokens_per_s": round(sum(view.tokens.rate(now) for view in self.workers.values()), 2),
                "rollout_groups_per_s": round(sum(view.groups.rate(now) for view in self.workers.values()), 3),
                "trained_trajectories_per_s": round(self.trained_groups.rate(now), 3),
                "trained_tokens_per_s": round(self.trained_tokens.rate(now), 2),
                "step_tokens_per_s": round(step.metrics.get("tokens_per_s", 0.0), 2) if step else None,
            },
            "reward": {
                "last": rewards[-1] if rewards else None,
                "mean_last_n": round(sum(rewards) / len(rewards), 4) if rewards else None,
                "trend": [round(r, 4) for r in rewards],
                "sparkline": sparkline(rewards),
            },
            "last_step": last_step,
            "lengths": self._lengths(),
            "trained": {k: int(self.totals.sums.get(k, 0.0)) for k in SUMMED},
            "rollout_episodes": rollout,
            "engine_errors": [wid for wid, w in workers.items() if w["engine_error"]],
            "engine_load_failures": sum(w["engine_load_failures"] for w in workers.values()),
            "engine_servers_down": [wid for wid, w in workers.items() if w["engine_server_down"]],
            "engine_restarts": sum(w["engine_restarts"] for w in workers.values()),
            "discards": {
                "dropped": int(tstats.get("dropped", 0)),
                "requeued": int(tstats.get("requeued", 0)),
                "duplicates": int(tstats.get("duplicates", 0)),
            },
            "controller": None
            if self.controller is None
            else {
                "issued": int(self.controller.stats.get("issued", 0)),
                "discarded": int(self.controller.stats.get("discarded", 0)),
            },
            "weights": self._weights_audit(),
            "dead_lettered": self.dead_lettered,
            **self._refused(),
            "evals": {str(k): a for k, a in evals.items()},
            "eval_results": eval_results,
            "eval_accuracy": evals[max(evals)] if evals else None,
        }


def _eval_version(msg: EvalResult) -> int:
    """The version an evaluation was issued for (its step is that version's)."""
    return msg.requested_version if msg.requested_version >= 0 else msg.policy_version


def _keep_newest(points: dict[int, Any], n: int) -> None:
    """Drop the oldest steps of ``points`` beyond ``n``."""
    for step in sorted(points)[: max(0, len(points) - n)]:
        del points[step]
