"""Learning-rate schedules: warm-up, decay ends, monotonicity."""

from __future__ import annotations

import pytest

from miles.backends.lr_schedule import lr_at
from miles.config import TrainerConfig


def test_constant_is_flat_after_warmup() -> None:
    cfg = TrainerConfig(lr=1e-3, steps=10, warmup_steps=4)
    assert [lr_at(cfg, s) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert all(lr_at(cfg, s) == 1e-3 for s in range(4, 10))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_runs_from_lr_to_the_floor_at_the_last_step(schedule: str) -> None:
    cfg = TrainerConfig(lr=1e-3, steps=101, lr_schedule=schedule, min_lr_ratio=0.1)
    lrs = [lr_at(cfg, s) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert lrs[50] == pytest.approx(5.5e-4)  # both schedules pass the midpoint halfway
    assert lr_at(cfg, 500) == pytest.approx(1e-4)  # past the end: stays at the floor
