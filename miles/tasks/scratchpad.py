"""Built-in task where longer reasoning is possible but unnecessary: addition with optional scratch work.

A completion may write scratch work before its answer, then commits with ``#`` and the sum::

    47+38=  ->  "add 47 and 38; #85"      (verbose, scratch "restate": 19 tokens with the character tokenizer)
    47+38=  ->  "7+8=15,4+3+1=8,#85"      (verbose, scratch "columns": column addition, 19 tokens)
    47+38=  ->  "#85"                      (direct: 4 tokens, <eos> included)

``restate`` (the default) only restates the problem: thinking aloud that is possible but unnecessary, so a
concise policy loses nothing. ``columns`` writes the digit-wise sums, which a tiny model does use: there,
answering directly is a harder skill to learn, and concision costs accuracy until it is learnt.

The reward reads only what follows the last ``#`` (exact match of the sum), so both forms score alike; a
completion cut off before its ``#`` scores 0, which is what makes a tight length cap teach concision. The
warm-up demonstrations are mostly verbose (``verbose_fraction``), so the warmed-up model thinks aloud by
default and only sometimes answers directly: the self-distillation demo (recipes/selfdistill-*.yaml) first
trains a concise teacher with RL under a tight cap, then distills the original verbose model from it.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from miles.config_base import TaskBase
from miles.tasks.base import ExactMatchTask, Sample, first_answer

if TYPE_CHECKING:
    from miles.rollout.env import ChatMessage

ANSWER_MARK = "#"


class ScratchpadTaskConfig(TaskBase):
    """Addition whose completions may carry scratch work before ``#answer`` (docs/algorithms.md)."""

    type: Literal["scratchpad"] = "scratchpad"
    max_operand: int = Field(50, gt=0, description="Operands are drawn from [0, max_operand].")
    scratch: Literal["restate", "columns"] = Field(
        "restate", description="Scratch work of verbose demonstrations: restate the problem, or column addition."
    )
    verbose_fraction: float = Field(
        0.75, ge=0, le=1, description="Share of warm-up demonstrations that write scratch work before the answer."
    )
    train_size: int = Field(4000, gt=0, description="Number of training prompts.")
    eval_size: int = Field(200, gt=0, description="Number of held-out prompts (disjoint from train).")
    seed: int = Field(0, description="Seed of the problem generator and of the demonstrations' style.")


def scratch_work(a: int, b: int) -> str:
    """Column addition, least significant digit first: ``7+8=15,4+3+1=8,`` for 47 + 38 (carries written)."""
    steps: list[str] = []
    carry = 0
    while a or b or carry:
        da, db = a % 10, b % 10
        total = da + db + carry
        terms = f"{da}+{db}" + (f"+{carry}" if carry else "")
        steps.append(f"{terms}={total},")
        carry, a, b = total // 10, a // 10, b // 10
    return "".join(steps) or "0+0=0,"


def restatement(a: int, b: int) -> str:
    """Scratch work that computes nothing: ``add 47 and 38; ``."""
    return f"add {a} and {b}; "


def committed_answer(completion: str) -> str | None:
    """What a completion commits to: the text after its last ``#``, cut like :func:`first_answer`; None
    without a ``#`` (it never answered, e.g. cut off while thinking)."""
    cut = completion.rfind(ANSWER_MARK)
    if cut < 0:
        return None
    return first_answer(completion[cut + 1 :])


class ScratchpadTask(ExactMatchTask):
    """``a+b=`` problems; reward 1 iff the committed answer is the sum. Deterministic, disjoint splits."""

    def __init__(self, cfg: ScratchpadTaskConfig) -> None:
        self.cfg = cfg
        side = cfg.max_operand + 1
        total = side * side
        if cfg.eval_size >= total:
            raise ValueError(
                f"scratchpad task: eval_size ({cfg.eval_size}) must be smaller than the number of distinct "
                f"problems ({total}); raise max_operand or lower eval_size"
            )
        rng = random.Random(cfg.seed)
        eval_idx = rng.sample(range(total), cfg.eval_size)
        eval_set = set(eval_idx)
        train_idx: list[int] = []
        while len(train_idx) < cfg.train_size:
            i = rng.randrange(total)
            if i not in eval_set:
                train_idx.append(i)
        self._splits = {
            "train": [self._sample(f"train-{k}", i, side) for k, i in enumerate(train_idx)],
            "eval": [self._sample(f"eval-{k}", i, side) for k, i in enumerate(eval_idx)],
        }

    def _sample(self, sample_id: str, index: int, side: int) -> Sample:
        a, b = divmod(index, side)
        return Sample(id=sample_id, prompt=f"{a}+{b}=", answer=str(a + b), meta={"a": a, "b": b})

    def reward(self, completion: str, sample: Sample) -> float:
        return 1.0 if committed_answer(completion) == sample.answer else 0.0

    def demonstration(self, sample: Sample) -> list[ChatMessage]:
        """Verbose (scratch work, then ``#sum``) for a seeded ``verbose_fraction`` of samples, else ``#sum``."""
        verbose = random.Random(f"{self.cfg.seed}:{sample.id}").random() < self.cfg.verbose_fraction
        a, b = int(sample.meta["a"]), int(sample.meta["b"])
        write = scratch_work if self.cfg.scratch == "columns" else restatement
        scratch = write(a, b) if verbose else ""
        content = f"{scratch}{ANSWER_MARK}{sample.answer}"
        return [{"role": "user", "content": sample.prompt}, {"role": "assistant", "content": content}]
