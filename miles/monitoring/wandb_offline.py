"""A W&B run in offline mode: the run's scalars under ``<run_dir>/wandb/``, uploaded later with ``wandb sync``.

Offline because actors must never depend on a hosted service being reachable (clusters often are not); the
files sync from any machine that is. W&B is optional: without the ``wandb`` package nothing is written.

W&B refuses a ``step`` lower than one already logged, and evaluations arrive after later steps, so train and
eval scalars each get their own step metric (``train/step``, ``eval/step``) instead of W&B's global step.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from miles.monitoring.tensorboard import scalars

log = structlog.get_logger(__name__)

PROJECT = "miles"


class WandbWriter:
    """``train/<metric>`` against ``train/step``, ``eval/accuracy`` against ``eval/step``."""

    def __init__(self, run_dir: Path, *, run_name: str, config: Mapping[str, Any] | None = None) -> None:
        self._run: Any = None
        try:
            import wandb
        except ImportError as exc:
            log.info("wandb_unavailable", reason=str(exc), hint="pip install wandb to get an offline W&B run")
            return
        settings = wandb.Settings(console="off", quiet=True, disable_git=True, x_disable_stats=True)
        self._run = wandb.init(
            mode="offline",
            dir=str(run_dir),
            project=PROJECT,
            name=run_name,
            config=dict(config or {}),
            settings=settings,
        )
        for axis in ("train", "eval"):
            self._run.define_metric(f"{axis}/step")
            self._run.define_metric(f"{axis}/*", step_metric=f"{axis}/step")
        log.info("wandb_offline", dir=str(self._run.dir))

    @property
    def available(self) -> bool:
        return self._run is not None

    def step(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._run is not None:
            self._run.log({**{f"train/{k}": v for k, v in scalars(metrics).items()}, "train/step": step})

    def eval(self, accuracy: float, step: int) -> None:
        if self._run is not None:
            self._run.log({"eval/accuracy": float(accuracy), "eval/step": step})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
