"""The policy objective: PPO-clip (clip-higher) with optional k3 KL to a reference and an entropy bonus.

Pure functions of token tensors so that they can be checked by hand and so that data-parallel
backends can reuse them unchanged: pass the *global* token / sequence counts as normalisers and the
returned loss and metrics become this shard's additive share of the global value (summing them over
ranks gives exactly what one rank would compute on the whole batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from miles.algo.registry import Registry
from miles.algo.segments import num_segments, segment_sum

Aggregation = Literal["token", "sequence"]


@dataclass(slots=True)
class PolicyLossOutput:
    """A differentiable scalar loss and detached scalar metrics.

    ``loss = pg_loss + kl_coef * kl_ref - entropy_coef * entropy``; ``pg_loss``, ``kl_ref`` and
    ``entropy`` are aggregated like the loss; ``clip_frac`` and ``ppo_kl`` are always means over
    masked tokens.
    """

    loss: Tensor
    metrics: dict[str, Tensor]


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: Aggregation = "token",
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    token_weights: Tensor | None = None,
    ratio_cap: float | None = None,
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    seq_index: Tensor | None = None,
) -> PolicyLossOutput:
    """PPO-clip loss over masked tokens.

    Args:
        logp: ``(B, T)`` log-probs of the taken tokens under the policy being optimised (with grad).
        old_logp: ``(B, T)`` log-probs under the proximal policy the ratio is taken against.
        advantages: ``(B,)`` per sequence (broadcast to its tokens) or ``(B, T)`` per token.
        mask: ``(B, T)`` 1 on tokens that are trained on (completion tokens), 0 elsewhere.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``; a larger
            ``clip_high`` (clip-higher) lets unlikely tokens with positive advantage grow faster.
        aggregation: ``"token"``: sum over all masked tokens / number of masked tokens, so long
            completions weigh more; ``"sequence"``: mean per sequence, then mean over sequences.
        ref_logp: ``(B, T)`` reference-policy log-probs; needed when ``kl_coef > 0``.
        kl_coef: weight of the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased).
        entropy: ``(B, T)`` per-token entropy of the policy (with grad when ``entropy_coef != 0``).
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        token_weights: ``(B, T)`` extra per-token multipliers of the policy-gradient term, e.g.
            truncated importance weights for off-policy correction. Detached: they scale, not steer.
        ratio_cap: truncate the ratio to ``min(ratio, ratio_cap)`` before the PPO clip (no gradient
            through truncated tokens; for negative advantages this is dual-clip PPO). Used when the
            ratio is taken against the behaviour policy (``miles.algo.offpolicy``, mode ``"tis"``);
            truncated tokens count in ``clip_frac``.
        num_tokens: normaliser of the token means (default: masked tokens here); pass the global
            count across data-parallel ranks.
        num_sequences: normaliser of the ``"sequence"`` mean (default: sequences here with at least
            one masked token); pass the global count across ranks.
        seq_index: ``(B, T)`` sequence of each token when rows are packed with several sequences
            (:mod:`miles.algo.segments`); default: each row is one sequence.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError("clip_low and clip_high must be >= 0")
    if aggregation not in ("token", "sequence"):
        raise ValueError(f"unknown aggregation {aggregation!r}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp")
    if entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    if ratio_cap is not None and ratio_cap <= 0:
        raise ValueError("ratio_cap must be > 0")

    mask = mask.to(logp.dtype)  # (B, T)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)  # (B, 1) broadcast over T

    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    truncated = torch.zeros_like(ratio, dtype=torch.bool)
    if ratio_cap is not None:
        truncated = ratio.detach() > ratio_cap
        ratio = torch.clamp(ratio, max=ratio_cap)
    unclipped = -adv * ratio  # (B, T)
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    pg = torch.maximum(unclipped, clipped)  # (B, T) pessimistic bound
    if token_weights is not None:
        pg = pg * token_weights.detach().to(logp.dtype)

    tokens = _normaliser(num_tokens, mask.sum(), logp)
    count = mask.shape[0] if seq_index is None else num_segments(seq_index)

    def per_sequence(per_token: Tensor) -> Tensor:  # (B, T) -> (S,) sums over each sequence's tokens
        if seq_index is None:
            return per_token.sum(dim=1)
        return segment_sum(per_token, seq_index, count)

    seq_lengths = per_sequence(mask)  # (S,)
    sequences = _normaliser(num_sequences, (seq_lengths > 0).sum(), logp)

    def aggregate(per_token: Tensor) -> Tensor:
        if aggregation == "token":
            return (per_token * mask).sum() / tokens
        per_seq = per_sequence(per_token * mask) / seq_lengths.clamp(min=1.0)  # (S,)
        return per_seq.sum() / sequences

    def token_mean(per_token: Tensor) -> Tensor:
        return ((per_token * mask).sum() / tokens).detach()

    pg_loss = aggregate(pg)
    loss = pg_loss
    zero = pg_loss.new_zeros(())

    kl_ref = zero
    if ref_logp is not None:
        delta = ref_logp.detach() - logp  # (B, T)
        kl_ref = aggregate(torch.exp(delta) - delta - 1.0)
        if kl_coef > 0:
            loss = loss + kl_coef * kl_ref

    ent = zero
    if entropy is not None:
        ent = aggregate(entropy)
        if entropy_coef != 0:
            loss = loss - entropy_coef * ent

    metrics = {
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "clip_frac": token_mean(((clipped > unclipped) | truncated).to(logp.dtype)),
        "ppo_kl": token_mean(-log_ratio),
        "kl_ref": kl_ref.detach(),
        "entropy": ent.detach(),
    }
    return PolicyLossOutput(loss=loss, metrics=metrics)


def _normaliser(given: float | Tensor | None, local: Tensor, like: Tensor) -> Tensor:
    """The divisor of a mean, never zero (an empty batch gives a zero loss, not NaN)."""
    value = local if given is None else torch.as_tensor(given)
    return value.to(device=like.device, dtype=like.dtype).clamp(min=1.0)


@dataclass(slots=True)
class LossInputs:
    """Everything a policy loss may use for one micro-batch, every tensor ``(R, L)``.

    ``base_logp`` is what the ratio is taken against (the proximal policy, or the behaviour policy for
    ``behaviour_ratio``); ``token_weights`` and ``ratio_cap`` come from the off-policy correction.
    ``num_tokens`` / ``num_sequences`` are the *global* counts of the mini-batch, so the returned loss and
    metrics are this micro-batch's additive share of the global value.
    """

    logp: Tensor
    base_logp: Tensor
    advantages: Tensor
    mask: Tensor
    seq_index: Tensor
    num_tokens: float
    num_sequences: float
    ref_logp: Tensor | None = None
    entropy: Tensor | None = None
    token_weights: Tensor | None = None
    ratio_cap: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0


class PolicyLoss(Protocol):
    """A policy-gradient loss: :class:`LossInputs` -> loss and metric shares (``loss``, ``pg_loss``,
    ``clip_frac``, ``ppo_kl``, ``kl_ref``, ``entropy``)."""

    def __call__(self, inputs: LossInputs) -> PolicyLossOutput: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(cfg: Any) -> PolicyLoss:
    """:func:`policy_loss` with the section's clip bounds and aggregation."""

    def loss(x: LossInputs) -> PolicyLossOutput:
        return policy_loss(
            x.logp,
            x.base_logp,
            x.advantages,
            x.mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            aggregation=cfg.aggregation,
            ref_logp=x.ref_logp,
            kl_coef=x.kl_coef,
            entropy=x.entropy,
            entropy_coef=x.entropy_coef,
            token_weights=x.token_weights,
            ratio_cap=x.ratio_cap,
            num_tokens=x.num_tokens,
            num_sequences=x.num_sequences,
            seq_index=x.seq_index,
        )

    return loss
