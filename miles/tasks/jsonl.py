"""User task: JSONL files of prompts plus a reward function named by import path.

Everything is validated when the task is built, so a typo in a recipe fails at startup with the
file and line, not hours later inside a rollout worker.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.config import JsonlData, JsonlTaskConfig
from miles.plugins import PluginError, import_callable
from miles.tasks.base import PROMPT_MESSAGES, Sample, TextTask

RewardFn = Callable[[str, Sample], float]


class TaskError(ValueError):
    """A task that cannot be built; the message names the file/line or import path at fault."""


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``'package.module:function'`` and check that it is callable."""
    try:
        return import_callable(spec, "reward")
    except PluginError as exc:
        raise TaskError(str(exc)) from None


class JsonlSplits:
    """The train and eval samples of a :class:`~miles.config.JsonlData` section, read once."""

    def __init__(self, cfg: JsonlData) -> None:
        self._splits = {
            "train": read_jsonl(cfg.train_path, "train", cfg.prompt_field, cfg.answer_field),
            "eval": read_jsonl(cfg.eval_path, "eval", cfg.prompt_field, cfg.answer_field),
        }

    def samples(self, split: str) -> list[Sample]:
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'eval'")
        return list(self._splits[split])


def read_jsonl(path: str | Path, split: str, prompt_field: str, answer_field: str) -> list[Sample]:
    """Parse one JSONL file into samples. Blank lines are skipped; every other line must be an object.

    The sample id is the row's ``id`` when present, else ``<split>-<line number>``; all other fields go
    into ``meta`` so that reward functions can use them.
    """
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"{p}: {split} file not found")
    samples: list[Sample] = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TaskError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for key in (prompt_field, answer_field):
                if key not in row:
                    raise TaskError(f"{p}:{lineno}: missing field {key!r}")
            prompt = row[prompt_field]
            meta = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
            if isinstance(prompt, list):  # a conversation: rendered with the chat template
                meta[PROMPT_MESSAGES] = _conversation(prompt, f"{p}:{lineno}: field {prompt_field!r}")
                prompt = meta[PROMPT_MESSAGES][-1]["content"]
            elif not isinstance(prompt, str):
                raise TaskError(f"{p}:{lineno}: field {prompt_field!r} must be a string or a list of messages")
            answer = row[answer_field]
            answer = answer if isinstance(answer, str) else json.dumps(answer)
            sample_id = str(row["id"]) if "id" in row else f"{split}-{lineno}"
            samples.append(Sample(id=sample_id, prompt=prompt, answer=answer, meta=meta))
    if not samples:
        raise TaskError(f"{p}: {split} file has no rows")
    return samples


def _conversation(value: list[Any], where: str) -> list[dict[str, str]]:
    """A row's prompt as messages: ``{"role", "content"}`` objects of text, ending with a user message."""
    messages = []
    for i, message in enumerate(value):
        ok = isinstance(message, dict) and isinstance(message.get("role"), str)
        if not ok or not isinstance(message.get("content"), str):
            raise TaskError(f"{where}[{i}] must be an object with a 'role' and a text 'content'")
        messages.append({"role": message["role"], "content": message["content"]})
    if not messages or messages[-1]["role"] != "user":
        raise TaskError(f"{where} must be a non-empty list of messages ending with a user message")
    return messages


class JsonlTask(TextTask):
    """Train/eval splits read from two JSONL files; ``reward`` delegates to the user's function."""

    def __init__(self, cfg: JsonlTaskConfig) -> None:
        self.cfg = cfg
        self.render = "chat" if cfg.render == "chat" else "raw"  # 'auto' is resolved with the model (RunConfig)
        self._reward_fn = load_reward_fn(cfg.reward)
        self._splits = JsonlSplits(cfg)
        if self.render == "raw":
            for split in ("train", "eval"):
                conversation = next((s for s in self._splits.samples(split) if PROMPT_MESSAGES in s.meta), None)
                if conversation is not None:
                    raise TaskError(
                        f"{split} sample {conversation.id!r}: a prompt given as messages needs task.render chat"
                    )

    def samples(self, split: str) -> list[Sample]:
        """The split's samples in file order."""
        return self._splits.samples(split)

    def reward(self, completion: str, sample: Sample) -> float:
        """The user's reward as a float."""
        return float(self._reward_fn(completion, sample))
