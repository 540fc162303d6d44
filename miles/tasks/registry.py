"""Build the task a config names: a built-in by ``type``, or a user's by import path (miles.plugins)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from miles.plugins import PluginError, Registry, import_callable, is_import_path
from miles.sandbox.config import SandboxConfig
from miles.tasks.base import Task

TASKS: Registry[Task] = Registry("task")  # factory(cfg, sandbox) -> Task
# What a task object must have (miles.tasks.base.Task), checked once when a user's task is built.
TASK_MEMBERS = ("samples", "environment", "render", "demonstration", "check")


def builtin_terminal_dir(builtin_cfg: Any) -> Path:
    """Where the built-in terminal family of this config is generated: a cache keyed by the config, so every
    process of a run (on any machine) finds the same task folders without sharing a run directory."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "miles" / "terminal-tasks"
    key = hashlib.sha256(json.dumps(builtin_cfg.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]
    return base / key


def _config_task(path: str) -> Any:
    """A built-in task class built from its config alone, imported on first use (the sandbox is not needed)."""

    def build(cfg: Any, sandbox: SandboxConfig) -> Task:
        return import_callable(path, "task")(cfg)  # type: ignore[no-any-return]

    return build


for _name, _path in {
    "arithmetic": "miles.tasks.arithmetic:ArithmeticTask",
    "jsonl": "miles.tasks.jsonl:JsonlTask",
    "copy": "miles.tasks.copy:CopyTask",
    "scratchpad": "miles.tasks.scratchpad:ScratchpadTask",
    "agent": "miles.tasks.agent:AgentTask",
}.items():
    TASKS.register(_name)(_config_task(_path))


@TASKS.register("terminal")
def _terminal(cfg: Any, sandbox: SandboxConfig) -> Task:
    from miles.sandbox.registry import build_provider
    from miles.tasks.terminal.task import load_terminal_tasks

    builtin_dir = builtin_terminal_dir(cfg.builtin) if cfg.builtin is not None else None
    return load_terminal_tasks(  # type: ignore[return-value]
        cfg, build_provider(sandbox), sandbox.limits.to_limits(), builtin_dir=builtin_dir
    )


def user_task(cfg: Any) -> Task:
    """A user's task: the class or factory at ``cfg.type``, called with its validated options (if it has a
    ``Config``); a one-line :class:`PluginError` when what it returns is not a task."""
    target = import_callable(cfg.type, "task.type")
    options = cfg.options()
    task = target() if options is None else target(options)
    missing = [name for name in TASK_MEMBERS if not hasattr(task, name)]
    if missing:
        raise PluginError(
            f"task.type {cfg.type!r} made a {type(task).__name__}, which lacks {', '.join(missing)} "
            "(a task: miles.tasks.base.Task, docs/extending.md)"
        )
    if task.render not in ("raw", "chat"):
        raise PluginError(f"task.type {cfg.type!r}: render must be 'raw' or 'chat', not {task.render!r}")
    return task


def build_task(cfg: Any, *, sandbox: SandboxConfig | None = None) -> Task:
    """The :class:`Task` for ``cfg``; JSONL files, reward imports and task folders are validated here.
    ``sandbox`` (``rollout.sandbox``) is where a terminal task's commands run."""
    if is_import_path(cfg.type):
        return user_task(cfg)
    return TASKS.factory(cfg.type)(cfg, sandbox or SandboxConfig())  # type: ignore[call-arg]
