"""Learning-rate schedules: a function of the optimizer step, so a resumed run continues the same curve."""

from __future__ import annotations

import math

from miles.config import TrainerConfig


def lr_at(cfg: TrainerConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) out of ``cfg.steps * cfg.algo.minibatches``.

    Linear warm-up over ``cfg.warmup_steps``, then ``cfg.lr_schedule``: ``constant``, or ``cosine`` /
    ``linear`` decay from ``cfg.lr`` to ``cfg.lr * cfg.min_lr_ratio`` at the last step.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps * cfg.algo.minibatches - 1 - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return cfg.lr - (cfg.lr - floor) * progress
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
