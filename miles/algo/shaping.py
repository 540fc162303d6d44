"""Reward shaping applied by the trainer before the advantage estimator: truncation and overlong penalties.

Torch-free and per episode, so that the group filter (:mod:`miles.algo.filters`) and the advantages see the
same shaped rewards.
"""

from __future__ import annotations

from typing import Any


def overlong_penalty(length: int, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13), added to the reward of a completion of
    ``length`` model tokens, with ``L_max = max_tokens`` and ``L_cache = buffer_tokens``::

        0                                   if length <= L_max - L_cache
        ((L_max - L_cache) - length) / L_cache * penalty   if L_max - L_cache < length <= L_max
        -penalty                            if length > L_max

    So a completion that ends inside the buffer loses a little, one that hits the limit loses ``penalty``.
    """
    if buffer_tokens < 1 or max_tokens < 1:
        raise ValueError("overlong shaping needs max_tokens >= 1 and buffer_tokens >= 1")
    start = max_tokens - buffer_tokens
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / buffer_tokens * penalty
    return -penalty


class RewardShaper:
    """``trainer.algo``'s reward shaping of one episode: ``truncated_reward`` replaces the reward of a
    truncated episode and ``unfinished_reward`` that of one that ran out of turns, then the
    ``reward_shaping`` term is added.

    Args:
        algo: the ``trainer.algo`` section.
        budget: the generation budget (:func:`miles.algo.config.generation_budget`), the default ``L_max``.
    """

    def __init__(self, algo: Any, budget: int) -> None:
        self.truncated_reward: float | None = algo.truncated_reward
        self.unfinished_reward: float | None = algo.unfinished_reward
        shaping = algo.reward_shaping
        self.overlong = shaping if shaping.type == "overlong" else None
        self.max_tokens = int(self.overlong.max_tokens or budget) if self.overlong is not None else budget
        if self.overlong is not None and self.overlong.buffer_tokens > self.max_tokens:
            raise ValueError(
                f"trainer.algo.reward_shaping.buffer_tokens ({self.overlong.buffer_tokens}) exceeds max_tokens "
                f"({self.max_tokens})"
            )

    @property
    def active(self) -> bool:
        return self.truncated_reward is not None or self.unfinished_reward is not None or self.overlong is not None

    def __call__(self, reward: float, length: int, truncated: bool, end_reason: str = "done") -> float:
        """The shaped reward of an episode with ``length`` model tokens."""
        if truncated and self.truncated_reward is not None:
            reward = float(self.truncated_reward)
        if end_reason == "max_turns" and self.unfinished_reward is not None:
            reward = float(self.unfinished_reward)
        if self.overlong is not None:
            reward += overlong_penalty(length, self.max_tokens, self.overlong.buffer_tokens, self.overlong.penalty)
        return reward
