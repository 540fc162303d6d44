"""Built-in verifiable task: integer arithmetic ("12+7=" -> "19") with an exact-answer reward.

Small enough that a tiny model learns it in seconds on a CPU, yet held-out accuracy is a real
signal: the eval problems never appear in the train split, so a rise in eval accuracy means the
policy generalised rather than memorised.
"""

from __future__ import annotations

import random

from miles.config import ArithmeticTaskConfig
from miles.tasks.base import ExactMatchTask, Sample


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operation {op!r}")


class ArithmeticTask(ExactMatchTask):
    """``a op b =`` problems over ``[0, max_operand]``; train and eval are deterministic and disjoint.

    Every distinct problem has an index in ``[0, n_ops * (max_operand + 1) ** 2)``. The eval split is a
    seeded sample of distinct indices; the train split draws (with replacement, since ``train_size`` may
    exceed the number of distinct problems) from the indices that are not in eval.
    """

    def __init__(self, cfg: ArithmeticTaskConfig) -> None:
        self.cfg = cfg
        self._ops: list[str] = list(dict.fromkeys(cfg.operations))  # dedupe, keep order
        side = cfg.max_operand + 1
        self._side = side
        total = len(self._ops) * side * side
        if cfg.eval_size >= total:
            raise ValueError(
                f"arithmetic task: eval_size ({cfg.eval_size}) must be smaller than the number of distinct "
                f"problems ({total}) so that some are left for training; raise max_operand or lower eval_size"
            )
        rng = random.Random(cfg.seed)
        eval_idx = rng.sample(range(total), cfg.eval_size)  # distinct, no materialised range
        eval_set = set(eval_idx)
        train_idx: list[int] = []
        while len(train_idx) < cfg.train_size:
            i = rng.randrange(total)
            if i not in eval_set:
                train_idx.append(i)
        self._splits: dict[str, list[Sample]] = {
            "train": [self._sample(f"train-{k}", i) for k, i in enumerate(train_idx)],
            "eval": [self._sample(f"eval-{k}", i) for k, i in enumerate(eval_idx)],
        }

    def _sample(self, sample_id: str, index: int) -> Sample:
        op_i, rest = divmod(index, self._side * self._side)
        a, b = divmod(rest, self._side)
        op = self._ops[op_i]
        answer = str(_apply(op, a, b))
        return Sample(id=sample_id, prompt=f"{a}{op}{b}=", answer=answer, meta={"a": a, "b": b, "op": op})
