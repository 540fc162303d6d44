"""Build the task a config names (``cfg.type``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from miles.sandbox.config import SandboxConfig
from miles.tasks.base import Task


def builtin_terminal_dir(builtin_cfg: Any) -> Path:
    """Where the built-in terminal family of this config is generated: a cache keyed by the config, so every
    process of a run (on any machine) finds the same task folders without sharing a run directory."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "miles" / "terminal-tasks"
    key = hashlib.sha256(json.dumps(builtin_cfg.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]
    return base / key


def build_task(cfg: Any, *, sandbox: SandboxConfig | None = None) -> Task:
    """The :class:`Task` for ``cfg``; JSONL files, reward imports and task folders are validated here.
    ``sandbox`` (``rollout.sandbox``) is where a terminal task's commands run."""
    if cfg.type == "arithmetic":
        from miles.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(cfg)
    if cfg.type == "jsonl":
        from miles.tasks.jsonl import JsonlTask

        return JsonlTask(cfg)
    if cfg.type == "copy":
        from miles.tasks.copy import CopyTask

        return CopyTask(cfg)
    if cfg.type == "scratchpad":
        from miles.tasks.scratchpad import ScratchpadTask

        return ScratchpadTask(cfg)
    if cfg.type == "terminal":
        from miles.sandbox.registry import build_provider
        from miles.tasks.terminal.task import load_terminal_tasks

        sandbox = sandbox or SandboxConfig()
        builtin_dir = builtin_terminal_dir(cfg.builtin) if cfg.builtin is not None else None
        return load_terminal_tasks(  # type: ignore[return-value]
            cfg, build_provider(sandbox), sandbox.limits.to_limits(), builtin_dir=builtin_dir
        )
    raise ValueError(f"unknown task type {cfg.type!r}")
