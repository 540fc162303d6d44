"""Off-policy corrections between the behaviour, proximal and current policies.

Three policies take part in one training step (docs/staleness.md, "Off-policy corrections"):

* the **behaviour** policy ``mu``: the engine weights (and numerics) that sampled the tokens; its
  per-token log-probs travel with the trajectory;
* the **proximal** policy ``pi_prox``: the trainer's weights at the start of the rollout batch, from a
  no-grad forward (with several mini-batches, every mini-batch's ratio is taken against it);
* the **current** policy ``pi_theta``: the weights being optimised.

With ``k = pi_prox / mu`` per token (in log space, over trained tokens) the built-in corrections
(``trainer.algo.off_policy.type``) are

* ``none``: PPO ratio ``pi_theta / pi_prox``, weight 1 (the behaviour policy is ignored);
* ``decoupled_ppo``: PPO ratio ``pi_theta / pi_prox``, weight ``min(k, clip)`` (AReaL's decoupled
  objective with truncation; what slime and verl call TIS);
* ``behaviour_ratio``: PPO ratio ``min(pi_theta / mu, cap)`` against the behaviour policy, no weight and
  no proximal policy in the objective (the former ``tis``);
* ``masked_is``: ratio ``pi_theta / pi_prox``, weight ``k`` if ``low <= k <= high`` else 0 (IcePop);
* ``sequence``: ratio ``pi_theta / pi_prox``, weight ``min(prod_t k_t, clip)`` per sequence, on its tokens.

Everything is a pure function of token tensors. The statistics come back as additive sums so that a
backend can add them over micro-batches and ranks and only then turn them into means (:func:`summarize`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from miles.algo.segments import broadcast, num_segments, rows_as_sequences, segment_sum
from miles.plugins import Registry

# Keys of the additive sums every correction returns (all over trained tokens).
SUM_KEYS = ("is_tokens", "is_abs_log_ratio", "is_k3", "is_weight", "is_weight_sq", "is_clipped")
# Keys of the per-step metrics summarize() derives from them.
METRIC_KEYS = ("logp_mismatch", "behaviour_kl", "is_weight_mean", "is_ess", "is_clipped_frac")


@dataclass(slots=True)
class CorrectionOutput:
    """How a correction shapes the objective of one micro-batch.

    ``ratio_base``: the log-probs the PPO ratio is taken against; ``ratio_cap``: truncation of the ratio
    itself (``policy_loss(ratio_cap=...)``); ``token_weights``: detached ``(R, L)`` multipliers of the
    policy-gradient term (0 off the mask), or None; ``sums``: this micro-batch's :data:`SUM_KEYS`.
    """

    ratio_base: Tensor
    ratio_cap: float | None
    token_weights: Tensor | None
    sums: dict[str, Tensor]


class OffPolicyCorrection(Protocol):
    """``(prox_logp, behaviour_logp, mask, seq_index) -> CorrectionOutput``, tensors ``(R, L)``."""

    def __call__(
        self, prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, seq_index: Tensor
    ) -> CorrectionOutput: ...


CORRECTIONS: Registry[OffPolicyCorrection] = Registry("off-policy correction")


def _stats(log_k: Tensor, on: Tensor, weights: Tensor, clipped: Tensor) -> dict[str, Tensor]:
    """The additive mismatch statistics, in float64 so that the sums stay exact at scale.

    * ``is_tokens``: trained tokens ``N``; ``is_abs_log_ratio``: ``sum |log k|``;
    * ``is_k3``: ``sum (k - 1 - log k)``, the k3 estimator of ``KL(mu || pi_prox)`` (unbiased, >= 0);
    * ``is_weight``, ``is_weight_sq``: ``sum w`` and ``sum w^2`` of the effective weights (for
      ``behaviour_ratio``, ``min(k, cap)``: its ratio at the start of the step, where ``pi_theta = pi_prox``);
    * ``is_clipped``: tokens whose weight was masked to 0 or truncated.
    """
    log_k64, w64 = log_k.double(), weights.double()
    k64 = torch.exp(log_k64)
    return {
        "is_tokens": on.sum(dtype=torch.float64),
        "is_abs_log_ratio": log_k64.abs().sum(),
        "is_k3": torch.where(on, k64 - 1.0 - log_k64, 0.0).sum(),
        "is_weight": w64.sum(),
        "is_weight_sq": w64.square().sum(),
        "is_clipped": (clipped & on).sum(dtype=torch.float64),
    }


def _log_k(prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    on = mask.detach() > 0  # (R, L)
    return torch.where(on, prox_logp.detach() - behaviour_logp.detach(), 0.0), on


def _token_correction(
    prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, weight_fn: Any, *, as_weights: bool = True
) -> CorrectionOutput:
    with torch.no_grad():
        log_k, on = _log_k(prox_logp, behaviour_logp, mask)
        weights, clipped = weight_fn(torch.exp(log_k))  # (R, L) each
        weights = torch.where(on, weights, 0.0)
        sums = _stats(log_k, on, weights, clipped)
    return CorrectionOutput(prox_logp, None, weights if as_weights else None, sums)


@CORRECTIONS.register("none")
def _none(cfg: Any) -> OffPolicyCorrection:
    def correct(prox: Tensor, behaviour: Tensor, mask: Tensor, seq_index: Tensor) -> CorrectionOutput:
        return _token_correction(
            prox,
            behaviour,
            mask,
            lambda k: (torch.ones_like(k), torch.zeros_like(k, dtype=torch.bool)),
            as_weights=False,
        )

    return correct


@CORRECTIONS.register("decoupled_ppo")
def _decoupled_ppo(cfg: Any) -> OffPolicyCorrection:
    clip = float(cfg.clip)

    def correct(prox: Tensor, behaviour: Tensor, mask: Tensor, seq_index: Tensor) -> CorrectionOutput:
        return _token_correction(prox, behaviour, mask, lambda k: (k.clamp(max=clip), k > clip))

    return correct


@CORRECTIONS.register("behaviour_ratio")
def _behaviour_ratio(cfg: Any) -> OffPolicyCorrection:
    cap = float(cfg.cap)

    def correct(prox: Tensor, behaviour: Tensor, mask: Tensor, seq_index: Tensor) -> CorrectionOutput:
        out = _token_correction(prox, behaviour, mask, lambda k: (k.clamp(max=cap), k > cap), as_weights=False)
        return CorrectionOutput(behaviour, cap, None, out.sums)

    return correct


@CORRECTIONS.register("masked_is")
def _masked_is(cfg: Any) -> OffPolicyCorrection:
    low, high = float(cfg.low), float(cfg.high)

    def weights(k: Tensor) -> tuple[Tensor, Tensor]:
        keep = (k >= low) & (k <= high)
        return torch.where(keep, k, 0.0), ~keep

    def correct(prox: Tensor, behaviour: Tensor, mask: Tensor, seq_index: Tensor) -> CorrectionOutput:
        return _token_correction(prox, behaviour, mask, weights)

    return correct


@CORRECTIONS.register("sequence")
def _sequence(cfg: Any) -> OffPolicyCorrection:
    clip = float(cfg.clip)

    def correct(prox: Tensor, behaviour: Tensor, mask: Tensor, seq_index: Tensor) -> CorrectionOutput:
        with torch.no_grad():
            log_k, on = _log_k(prox, behaviour, mask)
            # The product of the token ratios is the sequence's likelihood ratio.
            seq_k = torch.exp(segment_sum(log_k, seq_index, num_segments(seq_index)))  # (S,)
            per_token = broadcast(seq_k, seq_index)  # (R, L)
            weights = torch.where(on, per_token.clamp(max=clip), 0.0)
            sums = _stats(log_k, on, weights, per_token > clip)
        return CorrectionOutput(prox, None, weights, sums)

    return correct


def build_correction(cfg: Any) -> OffPolicyCorrection:
    """The correction of a ``trainer.algo.off_policy`` section."""
    return CORRECTIONS.build(cfg)


def correct_rows(correction: OffPolicyCorrection, prox: Tensor, behaviour: Tensor, mask: Tensor) -> CorrectionOutput:
    """Apply a correction to an unpacked batch (each row one sequence)."""
    return correction(prox, behaviour, mask, rows_as_sequences(mask))


def summarize(sums: Mapping[str, float]) -> dict[str, float]:
    """Per-step metrics from the sums of a correction (added over micro-batches and ranks).

    * ``logp_mismatch``: mean ``|log pi_prox - log mu|``;
    * ``behaviour_kl``: mean k3 estimate of ``KL(mu || pi_prox)``;
    * ``is_weight_mean``: mean effective weight;
    * ``is_ess``: effective sample size ratio ``(sum w)^2 / (N sum w^2)`` in ``[0, 1]`` (1: uniform
      weights; 1 for an empty batch, 0 when every weight is 0);
    * ``is_clipped_frac``: fraction of tokens masked or truncated.
    """
    n = float(sums["is_tokens"])
    sum_w, sum_w2 = float(sums["is_weight"]), float(sums["is_weight_sq"])
    if n <= 0:
        return {"logp_mismatch": 0.0, "behaviour_kl": 0.0, "is_weight_mean": 1.0, "is_ess": 1.0, "is_clipped_frac": 0.0}
    return {
        "logp_mismatch": float(sums["is_abs_log_ratio"]) / n,
        "behaviour_kl": float(sums["is_k3"]) / n,
        "is_weight_mean": sum_w / n,
        "is_ess": sum_w * sum_w / (n * sum_w2) if sum_w2 > 0 else 0.0,
        "is_clipped_frac": float(sums["is_clipped"]) / n,
    }
