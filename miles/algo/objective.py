"""The RL objective every backend optimises: pieces from the registries, assembled into a loss function.

For one mini-batch, with global counts ``num_tokens`` and ``num_sequences`` (summed over data-parallel
ranks), :meth:`Objective.loss_fn` returns the :data:`~miles.backends.base.LossFn` a backend calls on each
micro-batch: the off-policy correction turns proximal and behaviour log-probs into the ratio's base and
token weights, the distillation term (if any) is folded into the advantages, and the policy loss (with the k3
KL to the reference and the entropy bonus) turns the current log-probs into this micro-batch's share of the
mini-batch loss. The returned metrics are additive: loss terms as shares of the global mean, the
correction's and the distillation's statistics as raw sums; :meth:`Objective.finalize` turns their totals into
the step's metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from miles.algo.advantages import ADVANTAGES, AdvantageEstimator
from miles.algo.distill import DISTILL_SUM_KEYS, distill_advantages, summarize_distill
from miles.algo.losses import POLICY_LOSSES, LossInputs, PolicyLoss
from miles.algo.offpolicy import CORRECTIONS, SUM_KEYS, OffPolicyCorrection, summarize
from miles.backends.base import LossFn, MicroBatch, TokenOutputs

# Loss metrics returned as additive shares of the mini-batch mean.
SHARE_KEYS = ("loss", "pg_loss", "clip_frac", "ppo_kl", "kl_ref", "entropy")


class Objective:
    """The configured advantage estimator, policy loss, correction, distillation, KL and entropy terms
    (``trainer.algo``).

    Args:
        algo: the ``trainer.algo`` section.
        generation_budget: most model tokens per episode (:func:`miles.algo.config.generation_budget`); the
            divisor of ``aggregation: constant`` when the loss section does not set ``constant_tokens``.
    """

    def __init__(self, algo: Any, *, generation_budget: int | None = None) -> None:
        self.cfg = algo
        self.advantages: AdvantageEstimator = ADVANTAGES.build(algo.advantage)
        loss_cfg = algo.loss
        if getattr(loss_cfg, "aggregation", None) == "constant" and loss_cfg.constant_tokens is None:
            if generation_budget is None:
                raise ValueError("trainer.algo.loss: aggregation 'constant' needs constant_tokens")
            loss_cfg = loss_cfg.model_copy(update={"constant_tokens": int(generation_budget)})
        self.policy_loss: PolicyLoss = POLICY_LOSSES.build(loss_cfg)
        self.correction: OffPolicyCorrection = CORRECTIONS.build(algo.off_policy)
        self.kl_coef = float(algo.kl_coef)
        self.entropy_coef = float(algo.entropy_coef)
        self.distill = getattr(algo, "distill", None)

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def needs_teacher(self) -> bool:
        """Whether micro-batches must carry ``teacher_logp`` (on-policy distillation)."""
        return self.distill is not None

    @property
    def gradient_needs_advantage(self) -> bool:
        """Whether the loss's gradient is exactly 0 on samples whose advantages are all 0 (no KL, entropy or
        distillation term pulls on them)."""
        return not (self.needs_reference or self.entropy_in_loss or self.needs_teacher)

    @property
    def entropy_in_loss(self) -> bool:
        """Whether the entropy needs gradients (else it is a metric, taken from the proximal pass)."""
        return self.entropy_coef != 0

    def loss_fn(self, num_tokens: float, num_sequences: float) -> LossFn:
        """The loss of one micro-batch of a mini-batch with these global counts."""

        def loss(out: TokenOutputs, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
            t = mb.tensors
            if "prox_logp" in t:
                prox_logp, prox_entropy = t["prox_logp"], t.get("prox_entropy")
            else:  # one mini-batch: the proximal policy is the one this forward ran (miles.training.step)
                prox_logp = out.logp.detach()
                prox_entropy = None if out.entropy is None else out.entropy.detach()
            corr = self.correction(prox_logp, t["behaviour_logp"], mb.loss_mask, mb.seq_index)
            entropy = out.entropy if self.entropy_in_loss else prox_entropy
            advantages, extra = t["advantages"], {}
            if self.distill is not None:
                if "teacher_logp" not in t:
                    raise ValueError("on-policy distillation: a micro-batch without teacher log-probs")
                advantages, extra = distill_advantages(
                    advantages,
                    prox_logp,
                    t["teacher_logp"],
                    mb.loss_mask,
                    coef=float(self.distill.coef),
                    task_reward=bool(self.distill.task_reward),
                )
            result = self.policy_loss(
                LossInputs(
                    logp=out.logp,
                    base_logp=corr.ratio_base,
                    advantages=advantages,
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
            return result.loss, {**result.metrics, **corr.sums, **extra}

        return loss

    def finalize(self, totals: Mapping[str, float], minibatches: int) -> dict[str, float]:
        """Step metrics from totals over micro-batches and ranks: loss shares averaged over mini-batches,
        correction and distillation sums turned into means (:func:`miles.algo.offpolicy.summarize`,
        :func:`miles.algo.distill.summarize_distill`).

        Each mini-batch's loss pass sees the whole mini-batch once, so the distillation sums over all
        mini-batches cover every trained token of the rollout batch exactly once."""
        out = {key: float(totals.get(key, 0.0)) / max(1, minibatches) for key in SHARE_KEYS}
        out |= summarize({key: float(totals.get(key, 0.0)) for key in SUM_KEYS})
        if self.distill is not None:
            out |= summarize_distill({key: float(totals.get(key, 0.0)) for key in DISTILL_SUM_KEYS})
        return out
