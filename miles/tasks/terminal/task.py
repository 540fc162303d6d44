"""Terminal tasks as a Miles task: prompt samples per split for the prompt stream, a ``TerminalEnv`` per episode.

The pieces a run wires together (see docs/agents.md):

1. Once, before the actors start: :func:`prepare_builtin` (only for the built-in family) writes the task
   folders into the run directory; :func:`miles.sandbox.registry.require_sandbox` checks that sandboxes start.
2. :func:`load_terminal_tasks` loads every folder (a bad one fails here, in one line) into :class:`TerminalTasks`.
3. The producer takes ``samples(split)``; a worker's episode runner calls ``environment(spec)`` for each
   episode and drives it (reset, step, reward, close).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from miles.rollout.env import ChatMessage, EpisodeSpec
from miles.sandbox.base import SandboxLimits, SandboxProvider
from miles.tasks.base import Sample
from miles.tasks.terminal.builtin import METADATA_KEY, demonstrations, generate
from miles.tasks.terminal.config import BuiltinTerminalConfig, TerminalTaskConfig
from miles.tasks.terminal.env import TerminalEnv
from miles.tasks.terminal.harbor import HarborTask, load_tasks

BUILTIN_STAMP = "miles_builtin.json"


class TerminalTasks:
    """Harbor tasks by split; each sample's id is ``"<split>:<task name>"``. Episodes are conversations
    rendered with the chat template; demonstrations (for the tiny model's warm-up) exist for the built-in
    family, whose solutions are known."""

    render: Literal["raw", "chat"] = "chat"

    def __init__(
        self,
        splits: Mapping[str, Sequence[HarborTask]],
        provider: SandboxProvider,
        limits: SandboxLimits,
        *,
        system_prompt: str | None = None,
        observation_chars: int = 512,
        observation_role: Literal["user", "tool"] = "user",
    ) -> None:
        self.provider = provider
        self.limits = limits
        self.system_prompt = system_prompt
        self.observation_chars = observation_chars
        self.observation_role = observation_role
        self._splits = {split: list(tasks) for split, tasks in splits.items()}
        self._by_id = {f"{split}:{t.name}": t for split, tasks in self._splits.items() for t in tasks}

    def samples(self, split: str) -> list[Sample]:
        """The split's samples: the instruction as prompt (for logs; the env renders the conversation)."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; expected one of {sorted(self._splits)}")
        return [
            Sample(id=f"{split}:{t.name}", prompt=t.instruction, answer="", meta={"task_dir": str(t.path)})
            for t in self._splits[split]
        ]

    def task(self, sample_id: str) -> HarborTask:
        try:
            return self._by_id[sample_id]
        except KeyError:
            raise KeyError(f"no terminal task with sample id {sample_id!r}") from None

    def demonstration(self, sample: Sample) -> list[ChatMessage]:
        """A correct conversation (built-in tasks only: a user's Harbor task has no known transcript)."""
        task = self.task(sample.id)
        if METADATA_KEY not in task.metadata:
            raise ValueError(
                f"task {sample.id!r} is a Harbor task of your own: no transcript is known to warm up a tiny model "
                "on; train a pretrained model on it (model.type: pretrained, docs/agents.md)"
            )
        return demonstrations(task, system_prompt=self.system_prompt, role=self.observation_role)

    def check(self) -> None:
        """One line and :class:`SandboxUnavailable` if no sandbox can start here: agents' commands never run
        unsandboxed."""
        self.provider.check()

    def environment(self, spec: EpisodeSpec) -> TerminalEnv:
        """A fresh :class:`TerminalEnv` for one episode of ``spec``'s task (an :class:`EnvironmentFactory`)."""
        return TerminalEnv(
            self.task(spec.sample_id),
            self.provider,
            self.limits,
            system_prompt=self.system_prompt,
            observation_chars=self.observation_chars,
            observation_role=self.observation_role,
        )


def prepare_builtin(cfg: BuiltinTerminalConfig, out_dir: Path) -> dict[str, Path]:
    """Generate the built-in family into ``out_dir`` once; later calls with the same config reuse it."""
    out_dir = Path(out_dir)
    stamp = out_dir / BUILTIN_STAMP
    wanted = cfg.model_dump(mode="json")
    if stamp.exists():
        found = json.loads(stamp.read_text())
        if found != wanted:
            raise ValueError(
                f"{out_dir} holds builtin terminal tasks of another config ({found}); use a fresh directory"
            )
        return {split: out_dir / split for split in ("train", "eval")}
    dirs = generate(out_dir, cfg)
    stamp.write_text(json.dumps(wanted, sort_keys=True) + "\n")
    return dirs


def load_terminal_tasks(
    cfg: TerminalTaskConfig, provider: SandboxProvider, limits: SandboxLimits, *, builtin_dir: Path | None = None
) -> TerminalTasks:
    """Load the config's task folders (``builtin_dir``: where :func:`prepare_builtin` wrote the built-in ones)."""
    if cfg.builtin is not None:
        if builtin_dir is None:
            raise ValueError("terminal task: the builtin family needs builtin_dir (where prepare_builtin wrote it)")
        dirs = prepare_builtin(cfg.builtin, builtin_dir)
    else:
        assert cfg.train_dir is not None and cfg.eval_dir is not None
        dirs = {"train": Path(cfg.train_dir), "eval": Path(cfg.eval_dir)}
    return TerminalTasks(
        {split: load_tasks(path) for split, path in dirs.items()},
        provider,
        limits,
        system_prompt=cfg.system_prompt,
        observation_chars=cfg.observation_chars,
        observation_role=cfg.observation_role,
    )
