"""Policy losses: PPO-clip (clip-higher), CISPO and GSPO, with optional k3 KL to a reference and an entropy bonus.

Pure functions of token tensors so that they can be checked by hand and so that data-parallel
backends can reuse them unchanged: pass the *global* token / sequence counts as normalisers and the
returned loss and metrics become this shard's additive share of the global value (summing them over
ranks gives exactly what one rank would compute on the whole batch).

Every loss is one *surrogate* (the per-token policy-gradient term, :func:`ppo_surrogate`,
:func:`cispo_surrogate`, :func:`gspo_surrogate`) assembled the same way by :func:`policy_loss`: token
weights of the off-policy correction, aggregation, the KL and entropy terms, the metrics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from miles.algo.segments import broadcast, num_segments, rows_as_sequences, segment_sum
from miles.plugins import Registry, import_callable

Aggregation = Literal["token", "sequence", "constant"]
# A user's per-token term (trainer.algo.loss type surrogate): (log_ratio, advantages, mask, seq_index) -> the
# term, or (term, where it clipped); every tensor (R, L).
SurrogateFn = Callable[[Tensor, Tensor, Tensor, Tensor], "Tensor | tuple[Tensor, Tensor]"]
Surrogate = Literal["ppo_clip", "cispo", "gspo"] | SurrogateFn


@dataclass(slots=True)
class PolicyLossOutput:
    """A differentiable scalar loss and detached scalar metrics.

    ``loss = pg_loss + kl_coef * kl_ref - entropy_coef * entropy``; ``pg_loss``, ``kl_ref`` and
    ``entropy`` are aggregated like the loss; ``clip_frac`` and ``ppo_kl`` are always means over
    masked tokens.
    """

    loss: Tensor
    metrics: dict[str, Tensor]


def ppo_surrogate(log_ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO-clip per token: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` with ``r = exp(log_ratio)``
    (the pessimistic bound; no gradient where the clipped term is taken). Returns the term and where it clipped."""
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def cispo_surrogate(
    log_ratio: Tensor,
    adv: Tensor,
    clip_low: float,
    clip_high: float,
    ratio_cap: float | None = None,
    mask_low: float | None = None,
    mask_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """CISPO per token (MiniMax-M1, eq. 4): ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi_theta``.

    Written as ``-sg(w) * A * r / sg(r)``: the same gradient, ``-w A grad log pi_theta``, with the value
    ``-w A`` (comparable with PPO's ``-A r``). Unlike PPO no token loses its gradient; the clip only bounds the
    weight. A ``ratio_cap`` (the ``behaviour_ratio`` correction's truncation) lowers the weight's upper bound
    to ``min(1 + clip_high, ratio_cap)``; it must not cut the gradient as it does in PPO's ratio.

    ``mask_low`` / ``mask_high`` add the token mask ``M`` of the paper's unified form (eq. 7): a token with
    ``A < 0`` and ``r < 1 - mask_low``, or ``A > 0`` and ``r > 1 + mask_high``, gets no gradient, which is
    PPO's trust region on that side (None: no mask, the paper's CISPO). Returns the term and where the weight
    was clipped or the token masked."""
    ratio = torch.exp(log_ratio)  # (B, T)
    upper = 1.0 + clip_high if ratio_cap is None else min(1.0 + clip_high, ratio_cap)
    weight = torch.clamp(ratio.detach(), 1.0 - clip_low, upper)
    term = -adv * weight * (ratio / ratio.detach())
    dropped = torch.zeros_like(ratio, dtype=torch.bool)
    if mask_low is not None:
        dropped = dropped | ((adv < 0) & (ratio.detach() < 1.0 - mask_low))
    if mask_high is not None:
        dropped = dropped | ((adv > 0) & (ratio.detach() > 1.0 + mask_high))
    return torch.where(dropped, 0.0, term), (weight != ratio.detach()) | dropped


def gspo_surrogate(
    log_ratio: Tensor, adv: Tensor, mask: Tensor, seq_index: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """GSPO (Zheng et al., 2025) per token, in its GSPO-token form.

    The sequence ratio is the geometric mean of its token ratios, ``s_i = exp(mean_{t in i} log r_t)``; each
    token carries ``s_{i,t} = sg(s_i) * r_t / sg(r_t)`` (the value ``s_i``, the gradient of ``s_i`` spread over
    the sequence's tokens) in the PPO-clip term ``max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high))``. With one
    advantage per sequence and the per-sequence mean this is exactly GSPO's
    ``-1/G sum_i min(s_i A_i, clip(s_i) A_i)``, value and gradient; per-token advantages (a distillation term)
    give GSPO-token."""
    on = mask > 0
    count = num_segments(seq_index)
    lengths = segment_sum(mask, seq_index, count).clamp(min=1.0)  # (S,)
    seq_log_ratio = segment_sum(torch.where(on, log_ratio, 0.0), seq_index, count) / lengths  # (S,)
    per_token = broadcast(seq_log_ratio, seq_index).detach() + log_ratio - log_ratio.detach()  # (R, L)
    return ppo_surrogate(per_token, adv, clip_low, clip_high)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: Aggregation = "token",
    surrogate: Surrogate = "ppo_clip",
    constant_tokens: int | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    token_weights: Tensor | None = None,
    ratio_cap: float | None = None,
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    seq_index: Tensor | None = None,
    cispo_mask: tuple[float | None, float | None] = (None, None),
) -> PolicyLossOutput:
    """A policy-gradient loss over masked tokens (PPO-clip by default).

    Args:
        logp: ``(B, T)`` log-probs of the taken tokens under the policy being optimised (with grad).
        old_logp: ``(B, T)`` log-probs under the proximal policy the ratio is taken against.
        advantages: ``(B,)`` per sequence (broadcast to its tokens) or ``(B, T)`` per token.
        mask: ``(B, T)`` 1 on tokens that are trained on (completion tokens), 0 elsewhere.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``; a larger
            ``clip_high`` (clip-higher) lets unlikely tokens with positive advantage grow faster.
        aggregation: ``"token"``: sum over all masked tokens / number of masked tokens, so long
            completions weigh more; ``"sequence"``: mean per sequence, then mean over sequences;
            ``"constant"``: sum over masked tokens / (sequences x ``constant_tokens``), no length
            normalisation at all (Dr. GRPO).
        surrogate: the per-token term: ``"ppo_clip"`` (:func:`ppo_surrogate`), ``"cispo"``
            (:func:`cispo_surrogate`), ``"gspo"`` (:func:`gspo_surrogate`, sequence ratios), or a user's
            function of ``(log_ratio, advantages, mask, seq_index)`` (:data:`SurrogateFn`; the ratio truncated
            at ``ratio_cap``, the clip bounds unused).
        constant_tokens: the per-sequence divisor of ``"constant"`` aggregation.
        ref_logp: ``(B, T)`` reference-policy log-probs; needed when ``kl_coef > 0``.
        kl_coef: weight of the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased).
        entropy: ``(B, T)`` per-token entropy of the policy (with grad when ``entropy_coef != 0``).
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        token_weights: ``(B, T)`` extra per-token multipliers of the policy-gradient term, e.g.
            truncated importance weights for off-policy correction. Detached: they scale, not steer.
        ratio_cap: truncate the ratio to ``min(ratio, ratio_cap)`` before the surrogate (no gradient
            through truncated tokens; for negative advantages this is dual-clip PPO). Used when the
            ratio is taken against the behaviour policy (``miles.algo.offpolicy``, ``behaviour_ratio``);
            truncated tokens count in ``clip_frac``.
        num_tokens: normaliser of the token means (default: masked tokens here); pass the global
            count across data-parallel ranks.
        num_sequences: normaliser of the ``"sequence"`` and ``"constant"`` means (default: sequences here
            with at least one masked token); pass the global count across ranks.
        seq_index: ``(B, T)`` sequence of each token when rows are packed with several sequences
            (:mod:`miles.algo.segments`); default: each row is one sequence.
        cispo_mask: ``(mask_low, mask_high)`` of :func:`cispo_surrogate` (only with ``surrogate="cispo"``).
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError("clip_low and clip_high must be >= 0")
    if aggregation not in ("token", "sequence", "constant"):
        raise ValueError(f"unknown aggregation {aggregation!r}")
    if aggregation == "constant" and (constant_tokens is None or constant_tokens < 1):
        raise ValueError("aggregation 'constant' needs constant_tokens >= 1")
    if not callable(surrogate) and surrogate not in ("ppo_clip", "cispo", "gspo"):
        raise ValueError(f"unknown surrogate {surrogate!r}")
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
    seqs = rows_as_sequences(mask) if seq_index is None else seq_index  # (B, T)

    log_ratio = logp - old_logp  # (B, T)
    truncated = torch.zeros_like(log_ratio, dtype=torch.bool)
    capped = log_ratio
    if ratio_cap is not None:
        cap = torch.log(torch.as_tensor(ratio_cap, dtype=logp.dtype))
        truncated = log_ratio.detach() > cap
        capped = torch.clamp(log_ratio, max=cap)
    if callable(surrogate):
        pg, clipped = _user_surrogate(surrogate, capped, adv.expand_as(log_ratio), mask, seqs)
    elif surrogate == "ppo_clip":
        pg, clipped = ppo_surrogate(capped, adv, clip_low, clip_high)
    elif surrogate == "cispo":  # the cap bounds CISPO's weight, never its gradient
        pg, clipped = cispo_surrogate(log_ratio, adv, clip_low, clip_high, ratio_cap, *cispo_mask)
    else:
        pg, clipped = gspo_surrogate(capped, adv.expand_as(log_ratio), mask, seqs, clip_low, clip_high)
    if token_weights is not None:
        pg = pg * token_weights.detach().to(logp.dtype)

    tokens = _normaliser(num_tokens, mask.sum(), logp)
    count = num_segments(seqs)
    seq_lengths = segment_sum(mask, seqs, count)  # (S,)
    sequences = _normaliser(num_sequences, (seq_lengths > 0).sum(), logp)

    def aggregate(per_token: Tensor) -> Tensor:
        if aggregation == "token":
            return (per_token * mask).sum() / tokens
        if aggregation == "constant":
            return (per_token * mask).sum() / (sequences * float(constant_tokens))  # type: ignore[arg-type]
        per_seq = segment_sum(per_token * mask, seqs, count) / seq_lengths.clamp(min=1.0)  # (S,)
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
        "clip_frac": token_mean((clipped | truncated).to(logp.dtype)),
        "ppo_kl": token_mean(-log_ratio),
        "kl_ref": kl_ref.detach(),
        "entropy": ent.detach(),
    }
    return PolicyLossOutput(loss=loss, metrics=metrics)


def _user_surrogate(
    fn: SurrogateFn, log_ratio: Tensor, adv: Tensor, mask: Tensor, seq_index: Tensor
) -> tuple[Tensor, Tensor]:
    """A user's per-token term and where it clipped (nowhere, unless it says), checked for shape."""
    out = fn(log_ratio, adv, mask, seq_index)
    term, clipped = out if isinstance(out, tuple) else (out, torch.zeros_like(log_ratio, dtype=torch.bool))
    if not isinstance(term, Tensor) or term.shape != log_ratio.shape:
        shape = tuple(term.shape) if isinstance(term, Tensor) else type(term).__name__
        want = tuple(log_ratio.shape)
        raise ValueError(f"trainer.algo.loss surrogate returned {shape}, not one term per token {want}")
    return term, clipped.to(torch.bool)


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


def _loss(surrogate: Surrogate, clip_low: float, clip_high: float, aggregation: Aggregation, **kw: Any) -> PolicyLoss:
    def loss(x: LossInputs) -> PolicyLossOutput:
        return policy_loss(
            x.logp,
            x.base_logp,
            x.advantages,
            x.mask,
            clip_low=clip_low,
            clip_high=clip_high,
            aggregation=aggregation,
            surrogate=surrogate,
            ref_logp=x.ref_logp,
            kl_coef=x.kl_coef,
            entropy=x.entropy,
            entropy_coef=x.entropy_coef,
            token_weights=x.token_weights,
            ratio_cap=x.ratio_cap,
            num_tokens=x.num_tokens,
            num_sequences=x.num_sequences,
            seq_index=x.seq_index,
            **kw,
        )

    return loss


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(cfg: Any) -> PolicyLoss:
    """:func:`policy_loss` with the section's clip bounds and aggregation (``constant`` needs
    ``cfg.constant_tokens`` resolved: :class:`miles.algo.objective.Objective` fills in the generation budget)."""
    if cfg.aggregation == "constant" and cfg.constant_tokens is None:
        raise ValueError("loss aggregation 'constant' needs constant_tokens (or a generation budget)")
    return _loss("ppo_clip", cfg.clip_low, cfg.clip_high, cfg.aggregation, constant_tokens=cfg.constant_tokens)


@POLICY_LOSSES.register("cispo")
def cispo(cfg: Any) -> PolicyLoss:
    """:func:`cispo_surrogate` with the section's weight bounds and aggregation."""
    return _loss("cispo", cfg.clip_low, cfg.clip_high, cfg.aggregation, cispo_mask=(cfg.mask_low, cfg.mask_high))


@POLICY_LOSSES.register("surrogate")
def surrogate(cfg: Any) -> PolicyLoss:
    """A user's per-token term (``cfg.path``, called with ``cfg.params``) in :func:`policy_loss`'s assembly."""
    fn = import_callable(cfg.path, "trainer.algo.loss.path")
    term = functools.partial(fn, **cfg.params) if cfg.params else fn
    return _loss(term, 0.0, 0.0, cfg.aggregation, constant_tokens=cfg.constant_tokens)


@POLICY_LOSSES.register("gspo")
def gspo(cfg: Any) -> PolicyLoss:
    """:func:`gspo_surrogate`: sequence ratios, clipped at the section's bounds, each sequence weighted equally."""
    return _loss("gspo", cfg.clip_low, cfg.clip_high, "sequence")
