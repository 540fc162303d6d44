"""Advantage estimators: GRPO group-relative advantages (with or without std scaling) and REINFORCE++.

Every prompt is sampled ``group_size`` times; a completion's advantage is its reward relative to
the others of its group, so no value network is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from miles.plugins import Registry

AdvantageKind = Literal["grpo", "grpo_no_std"]


def group_advantages(rewards: Tensor, kind: AdvantageKind = "grpo", eps: float = 1e-6) -> Tensor:
    """Advantages of a rectangular batch of groups.

    Args:
        rewards: ``(G, N)`` rewards, one row per prompt group, or ``(N,)`` for a single group.
        kind: ``"grpo"`` gives ``(r - mean) / (std + eps)``; ``"grpo_no_std"`` (Dr. GRPO) gives
            ``r - mean``, which avoids up-weighting groups that are nearly solved or nearly failed.
        eps: keeps the division finite when a group's spread is tiny.

    The standard deviation is the population one (``correction=0``): it is defined for every group
    size, including 1, and a two-sample group {0, 1} maps to exactly {-1, +1}.

    Groups whose rewards are all equal carry no learning signal; they get an exact zero advantage
    (computing ``r - mean`` in floating point could leave a rounding residue).

    Returns:
        Advantages shaped like ``rewards``, in its dtype (float32 if it was an integer tensor).
    """
    if rewards.dim() == 1:
        return group_advantages(rewards.unsqueeze(0), kind, eps)[0]
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (G, N) or (N,), got shape {tuple(rewards.shape)}")
    if kind not in ("grpo", "grpo_no_std"):
        raise ValueError(f"unknown advantage kind {kind!r}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)  # (G, 1)
    centred = rewards - mean  # (G, N)
    if kind == "grpo":
        std = rewards.std(dim=1, keepdim=True, correction=0)  # (G, 1)
        centred = centred / (std + eps)
    degenerate = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)  # (G, 1)
    return torch.where(degenerate, torch.zeros_like(centred), centred)


def group_advantages_ragged(
    groups: Sequence[Sequence[float]], kind: AdvantageKind = "grpo", eps: float = 1e-6
) -> list[list[float]]:
    """Same as :func:`group_advantages` for groups of different sizes (e.g. after dropping stale samples)."""
    out: list[list[float]] = []
    for group in groups:
        if len(group) == 0:
            out.append([])
            continue
        out.append(group_advantages(torch.tensor(list(group), dtype=torch.float64), kind, eps).tolist())
    return out


class AdvantageEstimator(Protocol):
    """Rewards of each prompt group (the valid samples only) -> one advantage per sample, same shape.

    It sees the whole rollout batch, so batch-level estimators (a global baseline or normaliser) fit too.
    """

    def __call__(self, groups: Sequence[Sequence[float]]) -> list[list[float]]: ...


ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator")


@ADVANTAGES.register("grpo")
def _grpo(cfg: Any) -> AdvantageEstimator:
    return lambda groups: group_advantages_ragged(groups, "grpo", cfg.eps)


@ADVANTAGES.register("grpo_no_std")
def _grpo_no_std(cfg: Any) -> AdvantageEstimator:
    return lambda groups: group_advantages_ragged(groups, "grpo_no_std")


def batch_whitened(groups: Sequence[Sequence[float]], *, baseline: bool, eps: float = 1e-6) -> list[list[float]]:
    """REINFORCE++ advantages of a rollout batch (Hu et al., 2025), one per sample, shaped like ``groups``.

    * ``baseline=False`` (REINFORCE++): no group baseline, ``A = (r - mean_B r) / (std_B r + eps)``, the mean and
      (population) std over every sample of the batch;
    * ``baseline=True`` (REINFORCE++-baseline): ``a = r - mean_g r`` within each group first, then
      ``A = (a - mean_B a) / (std_B a + eps)`` over the batch.

    Unlike GRPO's, a group of equal rewards keeps a non-zero advantage without the baseline (its reward is
    compared with the rest of the batch); with it, such a group's advantages are exactly 0.
    """
    sizes = [len(g) for g in groups]
    flat = torch.tensor([float(r) for g in groups for r in g], dtype=torch.float64)  # (N,)
    if flat.numel() == 0:
        return [[] for _ in groups]
    if baseline:
        centred = [group_advantages(torch.tensor(list(g), dtype=torch.float64), "grpo_no_std") for g in groups if g]
        flat = torch.cat(centred)
    whitened = (flat - flat.mean()) / (flat.std(correction=0) + eps)
    if baseline:  # groups of equal rewards stay exactly 0 (the batch mean of centred rewards is 0 up to rounding)
        whitened = torch.where(flat == 0, torch.zeros_like(whitened), whitened)
    out, start = [], 0
    for n in sizes:
        out.append(whitened[start : start + n].tolist())
        start += n
    return out


@ADVANTAGES.register("reinforce_pp")
def _reinforce_pp(cfg: Any) -> AdvantageEstimator:
    return lambda groups: batch_whitened(groups, baseline=False, eps=cfg.eps)


@ADVANTAGES.register("reinforce_pp_baseline")
def _reinforce_pp_baseline(cfg: Any) -> AdvantageEstimator:
    return lambda groups: batch_whitened(groups, baseline=True, eps=cfg.eps)
