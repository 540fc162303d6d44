"""The run record's scalars fanned out to the experiment trackers: TensorBoard always (when installed),
W&B offline when the config asks for it (``monitor.wandb``) and ``wandb`` is installed.

One object with the record's three calls, so :class:`miles.actors.run_record.RunRecord` needs no knowledge
of which trackers exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from miles.monitoring.tensorboard import TensorboardWriter


class ScalarWriter(Protocol):
    def step(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def eval(self, accuracy: float, step: int) -> None: ...

    def close(self) -> None: ...


class RunScalars:
    """Step metrics and evaluations of one run to every configured tracker."""

    def __init__(
        self,
        run_dir: Path,
        *,
        run_name: str,
        wandb: bool = False,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.writers: list[ScalarWriter] = [TensorboardWriter(run_dir)]
        if wandb:
            from miles.monitoring.wandb_offline import WandbWriter

            self.writers.append(WandbWriter(run_dir, run_name=run_name, config=config))

    def step(self, metrics: Mapping[str, Any], step: int) -> None:
        """One metrics.jsonl line (its non-numeric and bookkeeping fields are skipped) at ``step``."""
        for writer in self.writers:
            writer.step(metrics, step)

    def eval(self, accuracy: float, step: int) -> None:
        """An evaluation of the version trained for ``step`` batches (0: the initial policy)."""
        for writer in self.writers:
            writer.eval(accuracy, step)

    def close(self) -> None:
        """Close every writer once (idempotent)."""
        writers, self.writers = self.writers, []
        for writer in writers:
            writer.close()
