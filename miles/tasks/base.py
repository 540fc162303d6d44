"""The task interface: a dataset of samples, and the environment an episode of one sample runs in.

Every task runs on the episode path (:mod:`miles.rollout.episode`): a single-turn text task is an
environment of one user message and one model turn (:class:`TextTask`), a terminal task one with a sandbox
and a verifier. ``render`` says how an episode's opening messages become token ids (``raw``: BOS + text;
``chat``: the tokenizer's chat template).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    from miles.rollout.env import ChatMessage, Environment, EpisodeSpec


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


# Where a sample keeps the messages of a conversational prompt (a JSONL row whose prompt is a list of messages).
PROMPT_MESSAGES = "prompt_messages"


def prompt_messages(sample: Sample) -> list[ChatMessage]:
    """The opening messages of ``sample``: its conversation, or one user message of its prompt."""
    messages = sample.meta.get(PROMPT_MESSAGES)
    return [dict(m) for m in messages] if messages else [{"role": "user", "content": sample.prompt}]


class TextTask(ABC):
    """Base of single-turn text tasks: subclasses provide ``samples`` and ``reward(completion, sample)``."""

    render: Literal["raw", "chat"] = "raw"
    # A reward that is a pure string check of microseconds may run on the event loop: handing it to a thread
    # costs more than the check, once per episode. Any other reward (a user's function) runs in a thread.
    reward_inline: ClassVar[bool] = False

    @abstractmethod
    def samples(self, split: str) -> list[Sample]:
        """Deterministic list of samples for ``split`` ("train" or "eval")."""

    @abstractmethod
    def reward(self, completion: str, sample: Sample) -> float:
        """Score one decoded completion (prompt excluded) of ``sample``."""

    def environment(self, spec: EpisodeSpec) -> Environment:
        from miles.rollout.single_turn import SingleTurnEnv

        return SingleTurnEnv(spec, self.reward, inline=self.reward_inline)

    def demonstration(self, sample: Sample) -> list[ChatMessage]:
        """A correct conversation for the supervised warm-up: the prompt and its reference answer."""
        return [*prompt_messages(sample), {"role": "assistant", "content": sample.answer}]

    def check(self) -> None:
        """Nothing to check at start-up for a text task."""


class ExactMatchTask(TextTask):
    """A task with fixed train/eval splits whose reward is an exact match of the first answer token.

    Subclasses build ``self._splits`` (``{"train": [...], "eval": [...]}``) in their constructor.
    """

    _splits: dict[str, list[Sample]]
    reward_inline = True  # a comparison of the first answer token (subclasses keep to string checks)

    def samples(self, split: str) -> list[Sample]:
        """The split's samples (a fresh list each call; the samples themselves are shared)."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'eval'")
        return list(self._splits[split])

    def reward(self, completion: str, sample: Sample) -> float:
        """1.0 iff the first whitespace-delimited token of the completion is exactly the answer."""
        return 1.0 if first_answer(completion) == sample.answer else 0.0


class Task(Protocol):
    """A dataset split into train and held-out eval, and the environment of each episode."""

    render: Literal["raw", "chat"]

    def samples(self, split: str) -> list[Sample]:
        """Deterministic list of samples for ``split`` ("train" or "eval")."""
        ...

    def environment(self, spec: EpisodeSpec) -> Environment:
        """A fresh environment for one episode of the sample ``spec`` names."""
        ...

    def demonstration(self, sample: Sample) -> list[ChatMessage]:
        """A correct full conversation for ``sample`` (the tiny model's supervised warm-up learns from it)."""
        ...

    def check(self) -> None:
        """Raise with one line if the task cannot run here (e.g. no sandbox can start)."""
        ...
