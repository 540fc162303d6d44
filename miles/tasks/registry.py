"""Build the task a config names (``cfg.type``)."""

from __future__ import annotations

from miles.config import ArithmeticTaskConfig, CopyTaskConfig, JsonlTaskConfig
from miles.tasks.base import Task


def build_task(cfg: ArithmeticTaskConfig | JsonlTaskConfig | CopyTaskConfig) -> Task:
    """The :class:`Task` for ``cfg``; JSONL files and the reward import are validated here."""
    if cfg.type == "arithmetic":
        from miles.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(cfg)
    if cfg.type == "jsonl":
        from miles.tasks.jsonl import JsonlTask

        return JsonlTask(cfg)
    if cfg.type == "copy":
        from miles.tasks.copy import CopyTask

        return CopyTask(cfg)
    raise ValueError(f"unknown task type {cfg.type!r}")
