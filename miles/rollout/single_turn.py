"""A single-turn text task as an environment: one user message, one model turn, a reward on the text.

This is how every task with a ``reward(completion, sample)`` (arithmetic, copy, a user's JSONL task) runs
on the same episode path as multi-turn agents. The reward runs in a worker thread, never on the event loop,
unless the task marks it a pure string check (``inline``), and receives the sample with all its fields
(``meta`` included) exactly as the controller issued them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from miles.rollout.env import ChatMessage, EnvStep, EpisodeSpec
from miles.tasks.base import Sample, prompt_messages

RewardFn = Callable[[str, Sample], float]


class SingleTurnEnv:
    """:class:`~miles.rollout.env.Environment` of one prompt and one answer."""

    def __init__(self, spec: EpisodeSpec, reward: RewardFn, *, inline: bool = False) -> None:
        self.sample = Sample(id=spec.sample_id, prompt=spec.prompt, answer=spec.answer, meta=dict(spec.meta))
        self._reward = reward
        self._inline = inline
        self._completion: str | None = None

    async def reset(self) -> list[ChatMessage]:
        return prompt_messages(self.sample)

    async def step(self, action: str) -> EnvStep:
        self._completion = action
        return EnvStep(done=True, end_reason="done")

    async def reward(self) -> float | None:
        # A turn cut off by a limit still has text to score; an episode that never produced one scores ''.
        if self._inline:
            return self._reward(self._completion or "", self.sample)
        return await asyncio.to_thread(self._reward, self._completion or "", self.sample)

    async def close(self) -> None:
        return None
