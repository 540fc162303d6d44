"""The self-distillation task: scratch work is allowed, only the committed answer counts, the warm-up is verbose."""

from __future__ import annotations

import pytest

from miles.config import load_config
from miles.tasks.registry import build_task
from miles.tasks.scratchpad import ScratchpadTask, ScratchpadTaskConfig, committed_answer, scratch_work


def test_only_the_committed_answer_is_scored() -> None:
    task = ScratchpadTask(ScratchpadTaskConfig(train_size=10, eval_size=5))
    sample = task.samples("train")[0]
    answer = sample.answer
    assert task.reward(f"#{answer}<eos>", sample) == 1.0
    assert task.reward(f"add 1 and 2; #{answer}", sample) == 1.0
    assert task.reward(f"#9{answer}", sample) == 0.0
    assert task.reward("add 1 and 2; ", sample) == 0.0  # cut off before its '#': never answered
    assert task.reward(f"{answer}", sample) == 0.0
    assert committed_answer("#1 #23 x") == "23" and committed_answer("no mark") is None


def test_column_scratch_work_is_correct_addition() -> None:
    assert scratch_work(47, 38) == "7+8=15,4+3+1=8,"
    assert scratch_work(99, 1) == "9+1=10,9+0+1=10,0+0+1=1,"
    assert scratch_work(0, 0) == "0+0=0,"


@pytest.mark.parametrize("scratch", ["restate", "columns"])
def test_demonstrations_are_mostly_verbose_and_always_correct(scratch: str) -> None:
    task = ScratchpadTask(ScratchpadTaskConfig(scratch=scratch, verbose_fraction=0.75, train_size=400))
    demos = [(s, task.demonstration(s)[1]["content"]) for s in task.samples("train")]
    verbose = sum(not content.startswith("#") for _, content in demos) / len(demos)
    assert 0.65 < verbose < 0.85
    assert all(task.reward(content, s) == 1.0 for s, content in demos)
    assert demos == [(s, task.demonstration(s)[1]["content"]) for s, _ in demos]  # deterministic


def test_splits_are_disjoint_and_the_config_selects_the_task() -> None:
    cfg = load_config(None, ["task.type=scratchpad", "task.max_operand=9", "task.eval_size=20"])
    task = build_task(cfg.task)
    assert isinstance(task, ScratchpadTask)
    assert not {s.prompt for s in task.samples("train")} & {s.prompt for s in task.samples("eval")}
    with pytest.raises(ValueError, match="eval_size"):
        ScratchpadTask(ScratchpadTaskConfig(max_operand=3, eval_size=16))


def test_run_info_names_the_committed_answer_reward_not_exact_match() -> None:
    from miles.bus.runinfo import task_info

    info = task_info(ScratchpadTaskConfig(train_size=10, eval_size=5))
    # a worker written from docs/protocol.md that scored exact_match would score "add 1 and 2; #3" as 0
    assert (info.type, info.environment, info.reward) == ("scratchpad", "single_turn", "committed_answer")
