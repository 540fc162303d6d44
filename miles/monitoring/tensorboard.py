"""TensorBoard event files of a run's scalars (step metrics and evaluations) in ``<run_dir>/tensorboard/``.

Written by the controller from the run record, so ``tensorboard --logdir runs/`` compares runs without any
extra process. TensorBoard is optional: without the ``tensorboard`` package nothing is written (logged once per
process, so a run never fails for want of a viewer). The events go through tensorboard's own event-file writer,
not ``torch.utils.tensorboard``: the controller imports no torch.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

TENSORBOARD_DIR = "tensorboard"
# Bookkeeping of a metrics.jsonl line, not curves: the x axis, the version id, the wall clock.
NOT_SCALARS = frozenset({"step", "policy_version", "time"})


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The plottable values of a metrics line: finite numbers (None, NaN, bools and text are left out)."""
    out = {}
    for key, value in metrics.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


@functools.cache
def _summary_writer() -> type | None:
    """:class:`_EventWriter` when TensorBoard imports, else None (logged the first time only)."""
    hint = "pip install tensorboard to get event files"
    if importlib.util.find_spec("tensorboard") is None:
        log.info("tensorboard_unavailable", reason="the tensorboard package is not installed", hint=hint)
        return None
    try:
        from tensorboard.compat.proto.event_pb2 import Event  # noqa: F401 (what _EventWriter needs, checked now)
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
    except ImportError as exc:
        log.info("tensorboard_unavailable", reason=str(exc), hint=hint)
        return None
    return _EventWriter


class _EventWriter:
    """Scalar events into one event file of ``log_dir`` (TensorBoard's format, its own writer)."""

    def __init__(self, log_dir: str, flush_secs: int) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._file = EventFileWriter(log_dir, flush_secs=flush_secs)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._file.add_event(Event(wall_time=time.time(), step=int(step), summary=summary))

    def close(self) -> None:
        self._file.close()


class TensorboardWriter:
    """Scalars under ``train/<metric>`` (x: step) and ``eval/accuracy`` (x: steps trained into the version)."""

    def __init__(self, run_dir: Path, *, flush_secs: int = 10) -> None:
        self.log_dir = run_dir / TENSORBOARD_DIR
        writer_cls = _summary_writer()
        self._writer: Any = None
        if writer_cls is not None:
            # A short flush interval: a live `tensorboard` sees the steps, and a killed controller loses little.
            self._writer = writer_cls(str(self.log_dir), flush_secs)

    @property
    def available(self) -> bool:
        return self._writer is not None

    def step(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._writer is None:
            return
        for key, value in scalars(metrics).items():
            self._writer.add_scalar(f"train/{key}", value, step)

    def eval(self, accuracy: float, step: int) -> None:
        if self._writer is not None:
            self._writer.add_scalar("eval/accuracy", float(accuracy), step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
