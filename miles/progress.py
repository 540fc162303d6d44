"""Terminal progress of a ``miles run``: a live bar on a terminal, one line per step otherwise.

It reads the run's METRICS stream like any other observer; nothing here is needed by the actors. A run started
again in the same run directory is shown from where it stands: the controller's newest snapshot gives the
steps done and the last evaluation, and only the reports stored after it are read.
Each step shows reward, staleness and throughput, plus turns per episode and completion length when the
task is multi-turn (an agent's episodes are what goes wrong first); each evaluation is printed as it
arrives, with the step it measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

import nats.errors
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from miles.actors.snapshots import newest_snapshot
from miles.actors.step_totals import StepTotals
from miles.bus.errors import BusError
from miles.bus.follow import follow
from miles.bus.schema import EvalResult, SchemaError, StepMetrics, decode_any
from miles.config import RunConfig
from miles.security.signing import SignatureError
from miles.training.lineage import VersionSteps, versions_kept


def is_multi_turn(cfg: RunConfig) -> bool:
    """Whether episodes can have several model turns (terminal tasks, or ``rollout.episode.max_turns > 1``)."""
    return cfg.rollout.episode.max_turns > 1 or cfg.task.type == "terminal"


def step_info(message: StepMetrics, *, multi_turn: bool, last_eval: float | None) -> str:
    """The one-line summary of a step: reward, staleness, throughput, and for agents turns and lengths."""
    m = message.metrics
    lag_max = max(message.staleness, default=0)
    lag_mean = sum(message.staleness) / max(1, len(message.staleness))
    info = f"reward {m.get('reward_mean', 0):.3f} | staleness {lag_mean:.2f} (max {lag_max})"
    if multi_turn:
        info += (
            f" | turns {m.get('turns_mean', 0):.1f} | len {m.get('length_mean', 0):.0f}"
            f" (p90 {m.get('length_p90', 0):.0f}, max {m.get('length_max', 0):.0f})"
        )
        excluded = m.get("infra_excluded", 0) + m.get("reward_failed", 0)
        if excluded:
            info += f" | excluded {excluded:.0f}"
    info += f" | {m.get('tokens_per_s', 0):.0f} tok/s | {m.get('step_s', 0):.2f} s/step"
    if last_eval is not None:
        info += f" | eval {last_eval:.3f}"
    return info


def eval_line(message: EvalResult, step: int | None) -> str:
    """An evaluation as it arrives: the step it measured (None: unknown), accuracy, samples and failures."""
    where = f"step {step}" if step is not None else f"version {message.policy_version}"
    line = f"eval  {where}: accuracy {message.accuracy:.3f} on {message.samples} samples"
    if message.failed:
        line += f" ({message.failed} failed)"
    return line


class ProgressView:
    def __init__(self, cfg: RunConfig, nats_url: str, *, quiet: bool = False) -> None:
        self.cfg = cfg
        self.nats_url = nats_url
        self.quiet = quiet
        self.console = Console(stderr=True)
        self.live = self.console.is_terminal and not quiet
        self._bus: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._done = asyncio.Event()
        self._progress: Progress | None = None
        self._task: Any = None
        self.last_eval: float | None = None
        self.multi_turn = is_multi_turn(cfg)
        # from step reports (step s publishes the version of step s + 1), the newest versions_kept(eta)
        self._version_steps = VersionSteps(versions_kept(self.cfg.staleness.max_staleness))
        self._print_every = max(1, cfg.trainer.steps // 20)  # plain (non-terminal) output: ~20 lines
        self._steps_done = 0  # steps the controller's newest snapshot had counted when the view started
        self._metrics_after = 0  # the METRICS sequence that snapshot had folded up to

    async def start(self) -> None:
        from miles.bus.client import Bus

        self.console.print(
            f"[bold]miles run[/] {self.cfg.name}: {self.cfg.trainer.steps} steps, "
            f"{self.cfg.rollout.workers} rollout workers, {self.cfg.trainer.ranks} trainer rank(s), "
            f"max_staleness={self.cfg.staleness.max_staleness}; bus {self.nats_url}"
        )
        # An observer like `miles top`: the monitor's identity (read-only) when the run has credentials.
        self._bus = await Bus.open(self.cfg.bus, self.nats_url, self.cfg.name, "launcher", role="monitor")
        await self._start_from_snapshot()
        self._reader = asyncio.create_task(self._read(), name="progress.metrics")
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=self.cfg.trainer.steps, completed=self._steps_done, info="starting actors..."
            )

    async def _start_from_snapshot(self) -> None:
        """Where a run started again stands (nothing on a fresh run: it has no snapshot yet)."""
        snapshot = await newest_snapshot(self._bus)
        if snapshot is None:
            return
        for version, step in snapshot.version_steps:
            self._version_steps.learn(version, step)
        evals = sorted(snapshot.record.evals)
        self.last_eval = evals[-1][1] if evals else None
        self._steps_done = len(StepTotals.from_part(snapshot.record.steps).steps)
        self._metrics_after = snapshot.positions["metrics"]
        if not self.quiet:
            self.console.print(f"resuming at step {self._steps_done}/{self.cfg.trainer.steps}")

    async def _read(self) -> None:
        """Queue every metrics message, in order, for :meth:`refresh` (skipping unverifiable ones)."""
        s = self._bus.subjects
        async for raw in follow(
            self._bus.nc, self._bus.js, s.metrics_stream, s.metrics_all, self._done, after_seq=self._metrics_after
        ):
            try:
                message = decode_any(raw.data)
                self._bus.check_signature(raw, message.KIND)
            except (SchemaError, SignatureError):
                continue
            self._inbox.put_nowait(message)

    async def refresh(self) -> None:
        if self._reader is not None and self._reader.done() and not self._reader.cancelled():
            if (exc := self._reader.exception()) is not None and not self._done.is_set():
                raise exc  # the view cannot follow the run: say so rather than show a frozen bar
        while not self._inbox.empty():
            self._show(self._inbox.get_nowait())

    def _show(self, message: Any) -> None:
        if isinstance(message, EvalResult):
            self._show_eval(message)
        elif isinstance(message, StepMetrics):
            self._show_step(message)

    def _eval_step(self, message: EvalResult) -> int | None:
        version = message.requested_version if message.requested_version >= 0 else message.policy_version
        if version in self._version_steps:
            return self._version_steps[version]
        return 0 if not self._version_steps else None  # before any step report: the initial policy

    def _show_eval(self, message: EvalResult) -> None:
        self.last_eval = message.accuracy
        if self.quiet:
            return
        self.console.print(eval_line(message, self._eval_step(message)))  # above the bar when it is live

    def _show_step(self, message: StepMetrics) -> None:
        self._version_steps.learn(message.policy_version, message.step + 1)
        if message.metrics.get("turns_mean", 0.0) > 1.0:
            self.multi_turn = True  # a task whose episodes turn out to have several turns
        info = step_info(message, multi_turn=self.multi_turn, last_eval=self.last_eval)
        if self._progress is not None:
            self._progress.update(self._task, completed=message.step + 1, info=info)
        elif not self.quiet and (message.step + 1) % self._print_every == 0:
            self.console.print(f"step {message.step + 1}/{self.cfg.trainer.steps} | {info}")

    def fail(self, what: str, tail: str) -> None:
        self._stop_bar()
        self.console.print(f"[bold red]miles run failed:[/] {what}")
        if tail:
            self.console.print(tail, markup=False, highlight=False)

    def print_summary(self, summary: dict[str, Any], run_dir: Path) -> None:
        keys = (
            "eval_before",
            "eval_after",
            "steps",
            "wall_s",
            "staleness_mean",
            "staleness_max",
            "trajectories_trained",
            "trajectories_dropped",
            "dead_lettered",
        )
        parts = [f"{k}={summary.get(k)!r}" for k in keys]
        print("summary: " + " ".join(parts), file=sys.stderr)
        for alarm in summary.get("alarms") or []:
            self.console.print(f"[bold red]ALARM:[/] {alarm}")
        print(
            f"run directory: {run_dir} (metrics.jsonl, evals.jsonl, summary.json, plots, logs/)",
            file=sys.stderr,
        )

    def _stop_bar(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    async def close(self) -> None:
        with contextlib.suppress(nats.errors.Error, BusError):  # the bus may have gone away with the run
            await self.refresh()
        self._stop_bar()
        self._done.set()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._bus is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._bus.nc.close()
