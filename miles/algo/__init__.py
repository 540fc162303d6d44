"""RL algorithm pieces as pure torch functions: group advantages, token log-probs, policy losses,
off-policy corrections.

Nothing here knows about ranks, models or the bus, so every formula is unit-testable by hand and
reusable by any backend.
"""

from miles.algo.advantages import AdvantageKind, group_advantages, group_advantages_ragged
from miles.algo.logprobs import token_entropy, token_logprobs
from miles.algo.losses import Aggregation, PolicyLossOutput, policy_loss
from miles.algo.offpolicy import OffPolicyMode, importance_weights, ratio_base, ratio_cap, summarize

__all__ = [
    "AdvantageKind",
    "Aggregation",
    "OffPolicyMode",
    "PolicyLossOutput",
    "group_advantages",
    "group_advantages_ragged",
    "importance_weights",
    "policy_loss",
    "ratio_base",
    "ratio_cap",
    "summarize",
    "token_entropy",
    "token_logprobs",
]
