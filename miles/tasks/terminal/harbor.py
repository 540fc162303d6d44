"""Load terminal tasks in the Harbor task format (Terminal-Bench 2): one folder per task.

A task folder holds::

    task.toml        metadata and timeouts ([agent] timeout_sec, [verifier] timeout_sec and env, ...)
    instruction.md   what the agent is told (its first user message)
    environment/     files the sandbox's work directory starts with (optional here; a Dockerfile in it is
                     ignored by the bubblewrap provider, which runs on the host's own /usr)
    tests/test.sh    the verifier: run after the agent finished, with tests/ at /tests (read-only) and
                     a fresh /logs/verifier/ where it writes reward.txt (a number) or reward.json

Only what Miles uses is validated; the rest of ``task.toml`` (resources, docker_image, authors, ...) is
kept in :attr:`HarborTask.config` and otherwise ignored. A bad folder raises :class:`TaskFormatError`
whose one-line message names the folder and the file.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_VERIFIER_TIMEOUT_S = 60.0


class TaskFormatError(ValueError):
    """A task folder does not follow the Harbor format; the message is one line naming folder and file."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Verifier(_Section):
    timeout_sec: float = Field(DEFAULT_VERIFIER_TIMEOUT_S, gt=0)
    env: dict[str, str] = {}


class _Agent(_Section):
    timeout_sec: float | None = Field(None, gt=0)


class _TaskMeta(_Section):
    name: str | None = None


class _TaskToml(_Section):
    task: _TaskMeta = Field(default_factory=_TaskMeta)
    metadata: dict[str, Any] = {}
    verifier: _Verifier = Field(default_factory=_Verifier)
    agent: _Agent = Field(default_factory=_Agent)


@dataclass(frozen=True, slots=True)
class HarborTask:
    """One loaded task folder."""

    name: str
    path: Path
    instruction: str
    environment: Path | None  # environment/ (None when the folder has none: the work dir starts empty)
    tests: Path  # tests/, holding test.sh
    verifier_timeout_s: float
    agent_timeout_s: float | None  # [agent] timeout_sec: the episode's wall clock, when the task sets one
    verifier_env: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)  # the whole task.toml


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    return f"{where}: {first['msg']}"


def load_task(folder: Path) -> HarborTask:
    """The task in ``folder``; :class:`TaskFormatError` if a file is missing or malformed."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TaskFormatError(f"{folder}: not a directory")
    toml_path = folder / "task.toml"
    if not toml_path.is_file():
        raise TaskFormatError(f"{toml_path}: missing")
    try:
        raw = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{toml_path}: {str(exc).splitlines()[0]}") from None
    try:
        meta = _TaskToml.model_validate(raw)
    except ValidationError as exc:
        raise TaskFormatError(f"{toml_path}: {_one_line(exc)}") from None
    bad_env = [k for k in meta.verifier.env if not (k.isidentifier() and k.isascii())]
    if bad_env:
        raise TaskFormatError(f"{toml_path}: verifier.env: {bad_env[0]!r} is not a shell variable name")
    instruction_path = folder / "instruction.md"
    if not instruction_path.is_file():
        raise TaskFormatError(f"{instruction_path}: missing")
    try:
        instruction = instruction_path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise TaskFormatError(f"{instruction_path}: not UTF-8 text") from None
    if not instruction:
        raise TaskFormatError(f"{instruction_path}: empty")
    tests = folder / "tests"
    if not (tests / "test.sh").is_file():
        raise TaskFormatError(f"{tests / 'test.sh'}: missing (the verifier that writes /logs/verifier/reward.txt)")
    environment = folder / "environment"
    if environment.exists() and not environment.is_dir():
        raise TaskFormatError(f"{environment}: not a directory")
    return HarborTask(
        name=meta.task.name or folder.name,
        path=folder,
        instruction=instruction,
        environment=environment if environment.is_dir() else None,
        tests=tests,
        verifier_timeout_s=meta.verifier.timeout_sec,
        agent_timeout_s=meta.agent.timeout_sec,
        verifier_env=dict(meta.verifier.env),
        metadata=dict(meta.metadata),
        config=raw,
    )


def load_tasks(root: Path) -> list[HarborTask]:
    """Every task under ``root`` (its subfolders, sorted; hidden ones skipped), or ``root`` itself if it is one.

    All folders are loaded before returning, so a dataset with one bad folder fails at start-up, not
    mid-run. Raises :class:`TaskFormatError`.
    """
    root = Path(root)
    if not root.is_dir():
        raise TaskFormatError(f"{root}: task directory does not exist")
    if (root / "task.toml").exists():
        return [load_task(root)]
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise TaskFormatError(f"{root}: no task folders (each needs task.toml, instruction.md, tests/test.sh)")
    tasks = [load_task(p) for p in folders]
    names: dict[str, Path] = {}
    for task in tasks:
        if task.name in names:
            raise TaskFormatError(
                f"{task.path / 'task.toml'}: task name {task.name!r} is also used by {names[task.name]}"
            )
        names[task.name] = task.path
    return tasks
