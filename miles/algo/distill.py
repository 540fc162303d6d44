"""On-policy distillation: a per-token reverse-KL term folded into the advantages.

The student samples; a frozen teacher scores the sampled tokens. For every trained token ``t``::

    A'_t = A_t - coef * (log pi_student(y_t) - log pi_teacher(y_t))

``log pi_student - log pi_teacher`` on a token the student sampled is a one-sample estimate of the reverse KL
``KL(pi_student || pi_teacher)`` at that position, so ``-coef`` times it is a dense per-token reward: tokens
the teacher finds likelier than the student are reinforced, the others pushed down. The term is added after
any advantage estimator and before any policy loss (PPO-clip, CISPO, GSPO alike), and only on tokens with
loss mask 1 (environment tokens of multi-turn episodes never count). ``task_reward=False`` drops ``A_t``
(pure distillation). The student's log-prob is the proximal one (the trainer's weights at the start of the
rollout batch, no gradient), computed by the same code as the teacher's.

A teacher identical to the student gives a term of exactly 0 on every token: nothing is distilled. The
trainer refuses such a teacher at start-up (:mod:`miles.training.teacher`), and every step whose mean reverse
KL is exactly 0 is flagged (``distill_kl_zero``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

# Additive sums of one micro-batch (added over micro-batches and ranks, then turned into means).
DISTILL_SUM_KEYS = ("distill_tokens", "distill_kl")


def distill_advantages(
    advantages: Tensor, student_logp: Tensor, teacher_logp: Tensor, mask: Tensor, *, coef: float, task_reward: bool
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(R, L)`` advantages with the distillation term, and the micro-batch's :data:`DISTILL_SUM_KEYS`.

    Every input is ``(R, L)``; the result is detached (a reward, not a path for gradients) and 0 off the mask.
    """
    on = mask.detach() > 0
    reverse_kl = torch.where(on, student_logp.detach() - teacher_logp.detach(), 0.0)  # (R, L)
    base = advantages.detach() if task_reward else torch.zeros_like(advantages)
    adjusted = torch.where(on, base - coef * reverse_kl, 0.0)
    sums = {"distill_tokens": on.sum(dtype=torch.float64), "distill_kl": reverse_kl.double().sum()}
    return adjusted, sums


def summarize_distill(sums: Mapping[str, float]) -> dict[str, float]:
    """Step metrics: ``distill_reverse_kl`` (mean over trained tokens of ``log pi_student - log pi_teacher``) and
    ``distill_kl_zero`` (1.0 when that mean is exactly 0 over a non-empty step: the teacher is the student)."""
    n, kl = float(sums.get("distill_tokens", 0.0)), float(sums.get("distill_kl", 0.0))
    mean = kl / n if n > 0 else 0.0
    return {"distill_reverse_kl": mean, "distill_kl_zero": 1.0 if n > 0 and kl == 0.0 else 0.0}
