"""The run directory's record: metrics.jsonl, evals.jsonl, the group ledger, and summary.json.

Written by the controller only, as a fold over the durable METRICS and EVENTS streams: at every start the
controller takes its newest snapshot (the record's totals and the files' sizes then) and replays what the streams
stored after it (:meth:`RunRecord.begin_rebuild` cuts the files back to those sizes first), so after any number
of controller restarts the files hold each step, evaluation and group event once, exactly as an
uninterrupted run writes them. Times come from the stream (when the server stored the message), not from
when the controller read it, so a rebuilt line is the line first written. The one field that does not
come from the streams, ``worker_lag_mean`` (from live heartbeats), is kept from the previous file when
it is there. Every file is valid JSON: a non-finite float (a skipped step's grad norm) is written as
null, never as a bare NaN.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, TextIO

import structlog

from miles.actors.step_totals import StepTotals
from miles.bus.schema import EvalResult, GroupsIssued, RecordPart, StepMetrics

log = structlog.get_logger(__name__)

# The step totals summary.json reports under their own names (the fold sums more: miles.actors.step_totals).
EPISODE_SUMS = (
    "infra_excluded",
    "reward_failed",
    "tool_calls",
    "parse_errors",
    "truncated",
    "sandbox_failures",
    "model_tokens",
    "stale_tokens_masked",
)


def finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (recursively), for strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _dumps(data: Any, **kw: Any) -> str:
    try:
        return json.dumps(data, allow_nan=False, **kw)
    except ValueError:  # a non-finite float somewhere (rare): walk the row only then, it is a third of a line's cost
        return json.dumps(finite(data), allow_nan=False, **kw)


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write(_dumps(data, indent=2, sort_keys=False))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunRecord:
    """Appends step metrics, evaluations and ledger lines; writes the summary at the end."""

    def __init__(
        self, run_dir: Path, *, run_name: str = "", wandb: bool = False, config: dict[str, Any] | None = None
    ) -> None:
        from miles.monitoring.scalars import RunScalars

        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / "metrics.jsonl"
        self.evals_path = run_dir / "evals.jsonl"
        self.ledger_path = run_dir / "groups.jsonl"
        self.summary_path = run_dir / "summary.json"
        started = run_dir / "started_at"
        if not started.exists():
            started.write_text(f"{time.time()}\n")
        self.started_at = float(started.read_text())
        self.evals: dict[int, float] = {}  # steps trained into the evaluated version -> accuracy
        self.eval_lengths: dict[int, float] = {}  # ... -> mean completion tokens (under eval.max_new_tokens)
        self.eval_versions: dict[int, int] = {}  # requested version -> step
        self.totals = StepTotals()  # over every step report, bounded for any run length (the monitor folds the same)
        self.dropped = 0
        self.requeued = 0
        self.discard_reasons: dict[str, int] = {}
        self.discarded_tokens: dict[str, int] = {}  # reason -> sampled tokens of the groups discarded for it
        self.groups_issued = 0
        self.last_step: StepMetrics | None = None
        self.rebuilding = False
        self._previous_lines: dict[int, dict[str, Any]] = {}  # step -> its line in the file being rebuilt
        # One append handle per file (a replay writes a line per group event: opening the file for each was
        # most of a restart's time), flushed after every live line and once at the end of a rebuild.
        self._files: dict[Path, TextIO] = {}
        # TensorBoard event files (and W&B, offline unless configured) of the same scalars, to overlay runs.
        self.scalars = RunScalars(run_dir, run_name=run_name or run_dir.name, wandb=wandb, config=config)

    def begin_rebuild(self, file_sizes: dict[str, int] | None = None) -> None:
        """Start the fold over: cut metrics.jsonl, evals.jsonl and the ledger back to ``file_sizes`` (what a
        snapshot had written; None: empty them) so that the replay of the streams after it writes the rest again,
        remembering the old step lines past the cut for what the streams do not hold. While rebuilding, the
        TensorBoard scalars (written by the controller's earlier life) are not written again."""
        self._previous_lines = {}
        self._close_files()
        sizes = file_sizes or {}
        for path in (self.metrics_path, self.evals_path, self.ledger_path):
            keep = sizes.get(path.name, 0)
            with open(path, "a+b") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() < keep:  # not the directory the run wrote: the lines before the snapshot are lost
                    log.error("record_lines_lost", file=str(path), size=f.tell(), snapshot_size=keep)
                    continue  # summary.json is exact (the snapshot's totals); the file holds what it holds
                if path == self.metrics_path:
                    f.seek(keep)
                    self._remember_lines(f.read())
                f.truncate(keep)
        self.rebuilding = True

    def _remember_lines(self, data: bytes) -> None:
        for line in data.decode("utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
                self._previous_lines[int(row["step"])] = row
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed controller: the stream has the step

    def end_rebuild(self) -> None:
        self.rebuilding = False
        self._previous_lines = {}
        for f in self._files.values():
            f.flush()

    def _append(self, path: Path, row: dict[str, Any]) -> None:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "a")  # noqa: SIM115 -- kept open until close()
        f.write(_dumps(row) + "\n")
        if not self.rebuilding:
            f.flush()  # a reader of the run directory sees every live event at once

    def _close_files(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}

    def ledger(self, event: str, t: float | None = None, **fields: Any) -> None:
        """One line per group event: issued, trained, dropped, requeued (the accounting trail). ``t``: when the
        event's message was stored (default now)."""
        self._append(self.ledger_path, {"event": event, "t": round(time.time() if t is None else t, 3), **fields})

    def issued(self, msg: GroupsIssued, t: float | None = None) -> None:
        """The ledger lines of an issue record (one per group)."""
        for i, sample_id in enumerate(msg.sample_ids):
            group_id = f"g{msg.first_index + i}"
            self.ledger("issued", t, group_id=group_id, sample_id=sample_id, version=msg.issued_at_version)
        self.groups_issued = max(self.groups_issued, msg.end_index)

    def count_discarded(self, n: int, requeue: bool, reason: str = "stale", model_tokens: int = 0) -> None:
        if requeue:
            self.requeued += n
        else:
            self.dropped += n
        self.discard_reasons[reason] = self.discard_reasons.get(reason, 0) + n
        self.discarded_tokens[reason] = self.discarded_tokens.get(reason, 0) + model_tokens

    def step(self, msg: StepMetrics, t: float | None = None, **extra: float) -> None:
        """A step's line and its ledger lines; ``t`` is when the report was stored (default now)."""
        if not self.totals.add(msg):  # a replayed step (a trainer restart re-trained a lost step)
            return
        t = time.time() if t is None else t
        previous = self._previous_lines.get(msg.step, {})
        extra = {k: previous.get(k, v) for k, v in extra.items()} if self.rebuilding else extra
        self.last_step = msg
        for gid, lag in zip(msg.trained_group_ids, msg.staleness, strict=True):
            self.ledger("trained", t, group_id=gid, step=msg.step, staleness=lag)
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
            "time": round(t - self.started_at, 3),
        }
        self._append(self.metrics_path, line)
        if not self.rebuilding:
            self.scalars.step(line, msg.step)

    def eval(self, msg: EvalResult, step: int, t: float | None = None) -> None:
        """An evaluation of the version trained for ``step`` rollout batches (0: the initial policy)."""
        if step in self.evals:
            return
        t = time.time() if t is None else t
        self.evals[step] = msg.accuracy
        self.eval_lengths[step] = msg.tokens / msg.samples if msg.samples else 0.0
        self.eval_versions[msg.requested_version] = step
        line = {
            "step": step,
            "requested_version": msg.requested_version,
            "policy_version": msg.policy_version,
            "eval_accuracy": msg.accuracy,
            "samples": msg.samples,
            "failed": msg.failed,
            "length_mean": self.eval_lengths[step],
            "time": round(t - self.started_at, 3),
        }
        self._append(self.evals_path, line)
        if not self.rebuilding:
            self.scalars.eval(msg.accuracy, step)

    def part(self) -> RecordPart:
        """The record's totals and file sizes, as a part of the controller's snapshot (flushed first, so the
        sizes are of lines written)."""
        for f in self._files.values():
            f.flush()
        version_of = {step: version for version, step in self.eval_versions.items()}
        return RecordPart(
            evals=[(step, acc, self.eval_lengths[step], version_of.get(step, -1)) for step, acc in self.evals.items()],
            steps=self.totals.part(),
            dropped=self.dropped,
            requeued=self.requeued,
            discard_reasons=dict(self.discard_reasons),
            discarded_tokens=dict(self.discarded_tokens),
            groups_issued=self.groups_issued,
            file_sizes={
                path.name: path.stat().st_size if path.exists() else 0
                for path in (self.metrics_path, self.evals_path, self.ledger_path)
            },
        )

    def restore(self, part: RecordPart) -> None:
        """Take the totals of a snapshot (before :meth:`begin_rebuild` with its file sizes)."""
        for step, accuracy, length, version in part.evals:
            self.evals[step], self.eval_lengths[step] = accuracy, length
            if version >= 0:
                self.eval_versions[version] = step
        self.totals = StepTotals.from_part(part.steps)
        self.dropped, self.requeued = part.dropped, part.requeued
        self.discard_reasons = dict(part.discard_reasons)
        self.discarded_tokens = dict(part.discarded_tokens)
        self.groups_issued = part.groups_issued

    def close(self) -> None:
        """Close the record's files and the TensorBoard / W&B writers (idempotent)."""
        self._close_files()
        self.scalars.close()

    def write_summary(self, **fields: Any) -> dict[str, Any]:
        """summary.json: the record's own figures plus ``fields`` from the controller (status, group
        accounting, dead letters, worker versions, and the weight audit). The audit counters default to 0
        so a reader can rely on them being present."""
        steps = sorted(self.evals)
        summary: dict[str, Any] = {
            "status": "complete",
            "eval_before": self.evals.get(0),
            "eval_after": self.evals[steps[-1]] if steps else None,
            "eval_after_step": steps[-1] if steps else None,
            "eval_length_before": self.eval_lengths.get(0),
            "eval_length_after": self.eval_lengths[steps[-1]] if steps else None,
            "wall_s": round(time.time() - self.started_at, 2),
            "staleness_mean": self.totals.staleness_mean,
            "staleness_max": self.totals.staleness_max,
            "trajectories_trained": self.totals.groups,
            "samples_trained": int(self.totals.sums.get("samples", 0.0)),
            "trajectories_dropped": self.dropped + self.requeued,
            "trajectories_requeued": self.requeued,
            "discard_reasons": dict(sorted(self.discard_reasons.items())),
            "model_tokens_discarded": dict(sorted(self.discarded_tokens.items())),
            "steps_replayed": self.totals.replayed,
            **{key: self.totals.sums.get(key, 0.0) for key in EPISODE_SUMS},
            "weights_verified": 0,
            "weights_mismatches": 0,
            **fields,
        }
        write_json_atomically(self.summary_path, summary)
        return summary
