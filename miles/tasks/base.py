"""The task interface: a prompt dataset with a reward function."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class Sample:
    """One prompt with whatever the reward needs to score completions of it."""

    id: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


# Text the decoder may leave in a completion when special tokens are not skipped: everything
# from the first of these on is ignored by the reward.
END_MARKERS: tuple[str, ...] = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<pad>")

_WHITESPACE = re.compile(r"\s")


def first_answer(completion: str) -> str:
    """The answer a completion commits to: stripped, cut at the first end marker or whitespace."""
    text = completion
    for marker in END_MARKERS:
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    text = text.strip()
    match = _WHITESPACE.search(text)
    return text[: match.start()] if match else text


class ExactMatchTask:
    """A task with fixed train/eval splits whose reward is an exact match of the first answer token.

    Subclasses build ``self._splits`` (``{"train": [...], "eval": [...]}``) in their constructor.
    """

    _splits: dict[str, list[Sample]]

    def samples(self, split: str) -> list[Sample]:
        """The split's samples (a fresh list each call; the samples themselves are shared)."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'eval'")
        return list(self._splits[split])

    def reward(self, completion: str, sample: Sample) -> float:
        """1.0 iff the first whitespace-delimited token of the completion is exactly the answer."""
        return 1.0 if first_answer(completion) == sample.answer else 0.0


class Task(Protocol):
    """A dataset split into train and held-out eval, plus a reward in [0, 1]."""

    def samples(self, split: str) -> list[Sample]:
        """Deterministic list of samples for ``split`` ("train" or "eval")."""
        ...

    def reward(self, completion: str, sample: Sample) -> float:
        """Score one decoded completion (prompt excluded) of ``sample``."""
        ...
