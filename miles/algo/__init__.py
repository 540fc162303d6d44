"""RL algorithm pieces as pure torch functions: group advantages, token log-probs, policy losses.

Nothing here knows about ranks, models or the bus, so every formula is unit-testable by hand and
reusable by any backend.
"""

from miles.algo.advantages import AdvantageKind, group_advantages, group_advantages_ragged
from miles.algo.logprobs import token_entropy, token_logprobs
from miles.algo.losses import Aggregation, PolicyLossOutput, policy_loss

__all__ = [
    "AdvantageKind",
    "Aggregation",
    "PolicyLossOutput",
    "group_advantages",
    "group_advantages_ragged",
    "policy_loss",
    "token_entropy",
    "token_logprobs",
]
