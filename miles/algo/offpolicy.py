"""Off-policy corrections between the behaviour, proximal and current policies.

Three policies take part in one training step (docs/staleness.md, "Off-policy corrections"):

* the **behaviour** policy ``mu``: the engine weights (and numerics) that sampled the tokens; its
  per-token log-probs travel with the trajectory;
* the **proximal** policy ``pi_prox``: the trainer's weights before this update, from a no-grad
  forward (in Miles one ``train_step`` is one optimizer step, so ``pi_prox`` is also where the
  update starts from);
* the **current** policy ``pi_theta``: the weights being optimised.

With ``k = pi_prox / mu`` per token (computed in log space over masked tokens) the modes are

* ``"none"``: PPO ratio ``pi_theta / pi_prox``, weight 1 (the behaviour policy is ignored);
* ``"decoupled_ppo"``: PPO ratio ``pi_theta / pi_prox``, weight ``min(k, tis_clip)`` (AReaL's
  decoupled objective, with truncation);
* ``"tis"``: PPO ratio ``min(pi_theta / mu, tis_clip)`` against the behaviour policy, no weight
  and no proximal policy in the objective;
* ``"masked_is"``: ratio ``pi_theta / pi_prox``, weight ``k`` if ``mis_low <= k <= mis_high``
  else 0 (IcePop-style masking that keeps the ratio);
* ``"sequence"``: ratio ``pi_theta / pi_prox``, weight ``min(prod_t k_t, tis_clip)`` per sequence,
  broadcast to its tokens.

Everything here is a pure function of token tensors. The statistics come back as additive sums so
that a data-parallel backend can add them over micro-batches and ranks and only then turn them into
means (:func:`summarize`), which keeps them exact under any sharding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol, get_args

import torch
from torch import Tensor

OffPolicyMode = Literal["none", "tis", "masked_is", "sequence", "decoupled_ppo"]
OFF_POLICY_MODES: tuple[str, ...] = get_args(OffPolicyMode)

# Keys of the additive sums returned by importance_weights (all over masked tokens).
SUM_KEYS = ("is_tokens", "is_abs_log_ratio", "is_k3", "is_weight", "is_weight_sq", "is_clipped")
# Keys of the per-step metrics summarize() derives from them.
METRIC_KEYS = ("logp_mismatch", "behaviour_kl", "is_weight_mean", "is_ess", "is_clipped_frac")


class OffPolicyParams(Protocol):
    """The knobs read here (``miles.config.AlgoConfig`` has them)."""

    tis_clip: float
    mis_low: float
    mis_high: float


def ratio_base(mode: str, prox_logp: Tensor, behaviour_logp: Tensor) -> Tensor:
    """The log-probs the PPO ratio is taken against: the behaviour policy for ``"tis"``, else the proximal one."""
    _check_mode(mode)
    return behaviour_logp if mode == "tis" else prox_logp


def ratio_cap(mode: str, cfg: OffPolicyParams) -> float | None:
    """Upper truncation of the PPO ratio itself (``policy_loss(ratio_cap=...)``): ``tis_clip`` for ``"tis"``."""
    _check_mode(mode)
    return float(cfg.tis_clip) if mode == "tis" else None


def importance_weights(
    mode: str, prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cfg: OffPolicyParams
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Per-token importance weights of ``mode`` and this batch's additive mismatch statistics.

    Args:
        mode: one of :data:`OFF_POLICY_MODES`.
        prox_logp: ``(B, T)`` proximal log-probs of the taken tokens (treated as constants).
        behaviour_logp: ``(B, T)`` behaviour (engine) log-probs of the same tokens.
        mask: ``(B, T)`` 1 on trained tokens; weights and statistics ignore the rest.
        cfg: ``tis_clip``, ``mis_low``, ``mis_high``.

    Returns:
        ``(token_weights, sums)``. ``token_weights`` is a detached ``(B, T)`` tensor (0 off the
        mask) to pass to ``policy_loss(token_weights=...)``, or ``None`` for ``"none"`` and
        ``"tis"`` (whose correction, if any, is in the ratio: see :func:`ratio_base`,
        :func:`ratio_cap`). ``sums`` maps each of :data:`SUM_KEYS` to a 0-d float64 tensor:

        * ``is_tokens``: masked tokens ``N``;
        * ``is_abs_log_ratio``: ``sum |log k|``;
        * ``is_k3``: ``sum (k - 1 - log k)``, the k3 estimator of ``KL(mu || pi_prox)`` from tokens
          sampled by ``mu`` (unbiased, non-negative);
        * ``is_weight``, ``is_weight_sq``: ``sum w`` and ``sum w^2`` of the effective weights ``w``:
          the token weights, 1 for ``"none"``, and ``min(k, tis_clip)`` for ``"tis"`` (its ratio at
          the start of the step, where ``pi_theta = pi_prox``);
        * ``is_clipped``: tokens whose weight was masked to 0 or truncated.
    """
    _check_mode(mode)
    with torch.no_grad():
        on = mask.detach() > 0  # (B, T)
        log_k = torch.where(on, prox_logp.detach() - behaviour_logp.detach(), 0.0)  # (B, T)
        k = torch.exp(log_k)  # (B, T), 1 off the mask
        if mode == "none":
            weights = torch.ones_like(k)
            clipped = torch.zeros_like(on)
        elif mode in ("tis", "decoupled_ppo"):
            weights = k.clamp(max=cfg.tis_clip)
            clipped = k > cfg.tis_clip
        elif mode == "masked_is":
            keep = (k >= cfg.mis_low) & (k <= cfg.mis_high)
            weights = torch.where(keep, k, 0.0)
            clipped = ~keep
        else:  # "sequence": the product of the token ratios is the sequence's likelihood ratio
            seq_k = torch.exp(log_k.sum(dim=1, keepdim=True))  # (B, 1)
            weights = seq_k.clamp(max=cfg.tis_clip).expand_as(k)
            clipped = (seq_k > cfg.tis_clip).expand_as(k)
        weights = torch.where(on, weights, 0.0)  # (B, T)
        clipped = clipped & on

        log_k64, w64 = log_k.double(), weights.double()  # sums in float64, so that they stay exact at scale
        k64 = torch.exp(log_k64)
        sums = {
            "is_tokens": on.sum(dtype=torch.float64),
            "is_abs_log_ratio": log_k64.abs().sum(),
            "is_k3": torch.where(on, k64 - 1.0 - log_k64, 0.0).sum(),
            "is_weight": w64.sum(),
            "is_weight_sq": w64.square().sum(),
            "is_clipped": clipped.sum(dtype=torch.float64),
        }
        token_weights = None if mode in ("none", "tis") else weights
    return token_weights, sums


def summarize(sums: Mapping[str, float]) -> dict[str, float]:
    """Per-step metrics from sums of :func:`importance_weights` (added over micro-batches and ranks).

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


def _check_mode(mode: str) -> None:
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off-policy mode {mode!r}; expected one of {OFF_POLICY_MODES}")
