"""The task interface: a prompt dataset with a reward function."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class Sample:
    """One prompt with whatever the reward needs to score completions of it."""

    id: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    """A dataset split into train and held-out eval, plus a reward in [0, 1]."""

    def samples(self, split: str) -> list[Sample]:
        """Deterministic list of samples for ``split`` ("train" or "eval")."""
        ...

    def reward(self, completion: str, sample: Sample) -> float:
        """Score one decoded completion (prompt excluded) of ``sample``."""
        ...
