"""CopyTask: long-tailed lengths (p99 >= 8x median), disjoint deterministic splits, exact-match reward, config."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config import ConfigError, CopyTaskConfig, TinyModelConfig, load_config
from miles.tasks.copy import CopyTask, completion_lengths, length_stats, percentile
from miles.tasks.registry import build_task

ROOT = Path(__file__).resolve().parents[2]


def test_default_lengths_are_long_tailed() -> None:
    stats = length_stats(CopyTask(CopyTaskConfig()).samples("train"))
    assert stats["p99"] >= 8 * stats["p50"], stats
    assert stats["p50"] <= 8 and stats["p100"] <= CopyTaskConfig().max_len + 1


def test_sigma_zero_gives_uniform_lengths() -> None:
    task = CopyTask(CopyTaskConfig(sigma=0, median_len=9, train_size=300, eval_size=30))
    assert set(completion_lengths(task.samples("train") + task.samples("eval"))) == {10}


def test_lengths_are_clipped() -> None:
    cfg = CopyTaskConfig(median_len=20, sigma=2.0, min_len=3, max_len=30, train_size=500, eval_size=50)
    lengths = [len(s.answer) for s in CopyTask(cfg).samples("train")]
    assert min(lengths) >= 3 and max(lengths) <= 30


def test_splits_deterministic_disjoint_and_sized() -> None:
    cfg = CopyTaskConfig(train_size=1000, eval_size=100, seed=5)
    a, b, c = CopyTask(cfg), CopyTask(cfg), CopyTask(cfg.model_copy(update={"seed": 6}))
    assert [s.prompt for s in a.samples("train")] == [s.prompt for s in b.samples("train")]
    assert [s.prompt for s in a.samples("train")] != [s.prompt for s in c.samples("train")]
    train, held_out = a.samples("train"), a.samples("eval")
    assert len(train) == 1000 and len(held_out) == 100
    assert len({s.prompt for s in held_out}) == 100
    assert not {s.prompt for s in held_out} & {s.prompt for s in train}
    with pytest.raises(ValueError, match="unknown split"):
        a.samples("test")


@pytest.mark.parametrize("reverse", [False, True])
def test_answers_and_reward(reverse: bool) -> None:
    task = CopyTask(CopyTaskConfig(reverse=reverse, train_size=50, eval_size=10))
    for s in task.samples("train"):
        digits = s.prompt[:-1]
        assert s.prompt.endswith("=") and digits.isdigit() and s.meta["length"] == len(digits)
        assert s.answer == (digits[::-1] if reverse else digits)
    s = task.samples("eval")[0]
    assert task.reward(s.answer, s) == 1.0
    assert task.reward(s.answer + "<eos>junk", s) == 1.0
    assert task.reward(f" {s.answer} more", s) == 1.0
    assert task.reward(s.answer + "1", s) == 0.0
    assert task.reward("", s) == 0.0


def test_percentile_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([7], 1) == 7


def test_bad_configs() -> None:
    with pytest.raises(ValueError, match="min_len"):
        CopyTask(CopyTaskConfig(min_len=5, max_len=3))
    with pytest.raises(ValueError, match="distinct eval strings"):
        CopyTask(CopyTaskConfig(sigma=0, median_len=1, eval_size=20))  # only 10 strings of length 1


def test_config_and_registry() -> None:
    cfg = load_config(ROOT / "recipes" / "async-longtail.yaml")
    assert isinstance(cfg.task, CopyTaskConfig)
    assert cfg.rollout.sampling.max_new_tokens >= cfg.task.max_len + 1
    task = build_task(CopyTaskConfig(train_size=20, eval_size=5))
    assert isinstance(task, CopyTask)
    with pytest.raises(ConfigError, match="task.sigma"):
        load_config(None, ["task.type=copy", "task.sigma=-1"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["task.type=copy", "task.operations=[+]"])


def test_tiny_model_builds_for_copy(tmp_path: Path) -> None:
    from miles.config import RunConfig
    from miles.models.loading import prepared_model_dir
    from miles.models.tiny import BUILD_INFO_FILE
    from miles.prepare import prepare_model

    model_cfg = TinyModelConfig(
        hidden_size=32, num_layers=1, num_heads=2, warmup_steps=3, warmup_batch_size=8, cache_dir=str(tmp_path)
    )
    task_cfg = CopyTaskConfig(train_size=100, eval_size=10, max_len=20)
    path = prepare_model(RunConfig(model=model_cfg, task=task_cfg))
    assert (path / BUILD_INFO_FILE).is_file() and (path / "config.json").is_file()
    assert prepared_model_dir(model_cfg, task_cfg) == path
