"""A multi-turn environment of your own, in one file: guess a hidden number, told "higher" or "lower".

Named in a recipe by import path, with no edit to Miles (examples/guess_game.yaml):

    task:
      type: guess_game:GuessGame    # this file, found in the directory `miles run` starts in
      high: 16                      # an option of GuessGame.Config

    cd examples && miles run guess_game.yaml --run-dir ../runs/guess

Each episode hides one number in [low, high]. The model's turn is a guess; the environment answers "higher"
or "lower" until the guess is right (reward 1) or the episode runs out of turns (reward 0). The model sees
only the replies, so it must search: halving the range finds any number of 1-16 in at most 4 guesses.

The tiny model's warm-up imitates two searches: mostly guessing one by one from the low end (found within 5
turns only for the 5 lowest numbers), sometimes halving. The warmed-up model can do both and starts with the
first habit; the reward teaches it the second.
"""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from miles.rollout.env import ChatMessage, EnvStep, EpisodeSpec
from miles.tasks.base import Sample

_NUMBER = re.compile(r"-?\d+")


class GuessEnv:
    """One episode (miles.rollout.env.Environment): text in, text out, a reward at the end."""

    def __init__(self, secret: int, low: int, high: int) -> None:
        self.secret, self.low, self.high = secret, low, high
        self.found = False

    async def reset(self) -> list[ChatMessage]:
        return [{"role": "user", "content": f"guess {self.low}-{self.high}"}]

    async def step(self, action: str) -> EnvStep:
        match = _NUMBER.search(action)
        if match is None:
            return EnvStep(messages=[{"role": "user", "content": "a number"}], info={"parse_errors": 1.0})
        guess = int(match.group())
        if guess == self.secret:
            self.found = True
            return EnvStep(done=True, end_reason="done")
        return EnvStep(messages=[{"role": "user", "content": "higher" if guess < self.secret else "lower"}])

    async def reward(self) -> float:
        return 1.0 if self.found else 0.0

    async def close(self) -> None:
        return None


class GuessGame:
    """The task (miles.tasks.base.Task): samples, one environment per episode, a demonstration for the tiny
    model's warm-up, and the chat rendering of its turns."""

    class Config(BaseModel):
        """The options under `task:` beside `type` (validated when the recipe is loaded)."""

        model_config = ConfigDict(extra="forbid")
        low: int = Field(1, description="Smallest hidden number.")
        high: int = Field(16, description="Largest hidden number.")
        linear_fraction: float = Field(
            0.6, ge=0, le=1, description="Warm-up transcripts that guess low, low+1, ... instead of halving."
        )
        train_size: int = Field(2000, gt=0)
        eval_size: int = Field(64, gt=0)
        seed: int = 0

    render: Literal["raw", "chat"] = "chat"

    def __init__(self, config: GuessGame.Config) -> None:
        if config.high <= config.low:
            raise ValueError(f"task.high ({config.high}) must be above task.low ({config.low})")
        self.config = config

    def samples(self, split: str) -> list[Sample]:
        if split not in ("train", "eval"):
            raise ValueError(f"unknown split {split!r}")
        c = self.config
        rng = random.Random(f"{c.seed}-{split}")
        count = c.train_size if split == "train" else c.eval_size
        prompt = f"guess {c.low}-{c.high}"
        return [Sample(id=f"{split}-{i}", prompt=prompt, answer=str(rng.randint(c.low, c.high))) for i in range(count)]

    def environment(self, spec: EpisodeSpec) -> GuessEnv:
        return GuessEnv(int(spec.answer), self.config.low, self.config.high)

    def demonstration(self, sample: Sample) -> list[ChatMessage]:
        """What the tiny model's warm-up imitates: for a share ``linear_fraction`` of the samples, guessing one by
        one from ``low`` (which runs out of turns above ``low + max_turns - 1``), for the others halving the
        range. The warmed-up model can do both; which one it starts with is what RL learns from the reward."""
        c, secret = self.config, int(sample.answer)
        linear = random.Random(f"{c.seed}-{sample.id}").random() < c.linear_fraction
        low, high = c.low, c.high
        messages: list[ChatMessage] = [{"role": "user", "content": sample.prompt}]
        while True:
            guess = low if linear else (low + high) // 2
            messages.append({"role": "assistant", "content": str(guess)})
            if guess == secret:
                return messages
            if guess < secret:
                low = guess + 1
                messages.append({"role": "user", "content": "higher"})
            else:
                high = guess - 1
                messages.append({"role": "user", "content": "lower"})

    def check(self) -> None:
        """Nothing to start: the game runs in the worker's process."""
