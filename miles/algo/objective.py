"""The RL objective every backend optimises: pieces from the registries, assembled into a loss function.

For one mini-batch, with global counts ``num_tokens`` and ``num_sequences`` (summed over data-parallel
ranks), :meth:`Objective.loss_fn` returns the :data:`~miles.backends.base.LossFn` a backend calls on each
micro-batch: the off-policy correction turns proximal and behaviour log-probs into the ratio's base and
token weights, the policy loss (with the k3 KL to the reference and the entropy bonus) turns the current
log-probs into this micro-batch's share of the mini-batch loss. The returned metrics are additive: loss
terms as shares of the global mean, the correction's statistics as raw sums; :meth:`Objective.finalize`
turns their totals into the step's metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from miles.algo.advantages import ADVANTAGES, AdvantageEstimator
from miles.algo.losses import POLICY_LOSSES, LossInputs, PolicyLoss
from miles.algo.offpolicy import CORRECTIONS, SUM_KEYS, OffPolicyCorrection, summarize
from miles.backends.base import LossFn, MicroBatch, TokenOutputs

# Loss metrics returned as additive shares of the mini-batch mean.
SHARE_KEYS = ("loss", "pg_loss", "clip_frac", "ppo_kl", "kl_ref", "entropy")


class Objective:
    """The configured advantage estimator, policy loss, correction, KL and entropy terms (``trainer.algo``)."""

    def __init__(self, algo: Any) -> None:
        self.cfg = algo
        self.advantages: AdvantageEstimator = ADVANTAGES.build(algo.advantage)
        self.policy_loss: PolicyLoss = POLICY_LOSSES.build(algo.loss)
        self.correction: OffPolicyCorrection = CORRECTIONS.build(algo.off_policy)
        self.kl_coef = float(algo.kl_coef)
        self.entropy_coef = float(algo.entropy_coef)

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def entropy_in_loss(self) -> bool:
        """Whether the entropy needs gradients (else it is a metric, taken from the proximal pass)."""
        return self.entropy_coef != 0

    def loss_fn(self, num_tokens: float, num_sequences: float) -> LossFn:
        """The loss of one micro-batch of a mini-batch with these global counts."""

        def loss(out: TokenOutputs, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
            t = mb.tensors
            corr = self.correction(t["prox_logp"], t["behaviour_logp"], mb.loss_mask, mb.seq_index)
            entropy = out.entropy if self.entropy_in_loss else t.get("prox_entropy")
            result = self.policy_loss(
                LossInputs(
                    logp=out.logp,
                    base_logp=corr.ratio_base,
                    advantages=t["advantages"],
                    mask=mb.loss_mask,
                    seq_index=mb.seq_index,
                    num_tokens=num_tokens,
                    num_sequences=num_sequences,
                    ref_logp=t.get("ref_logp"),
                    entropy=entropy,
                    token_weights=corr.token_weights,
                    ratio_cap=corr.ratio_cap,
                    kl_coef=self.kl_coef,
                    entropy_coef=self.entropy_coef,
                )
            )
            return result.loss, {**result.metrics, **corr.sums}

        return loss

    @staticmethod
    def finalize(totals: Mapping[str, float], minibatches: int) -> dict[str, float]:
        """Step metrics from totals over micro-batches and ranks: loss shares averaged over mini-batches,
        correction sums turned into means (:func:`miles.algo.offpolicy.summarize`)."""
        out = {key: float(totals.get(key, 0.0)) / max(1, minibatches) for key in SHARE_KEYS}
        out |= summarize({key: float(totals.get(key, 0.0)) for key in SUM_KEYS})
        return out
