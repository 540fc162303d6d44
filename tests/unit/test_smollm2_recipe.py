"""The SmolLM2 recipe's task: conversational rows from its data, and a reward restating the question cannot win."""

from __future__ import annotations

from pathlib import Path

from miles.config import load_config
from miles.tasks.base import PROMPT_MESSAGES
from miles.tasks.registry import build_task

ROOT = Path(__file__).resolve().parents[2]


def test_the_recipe_builds_a_chat_rendered_conversational_task(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(ROOT)  # the recipe's paths and reward module are relative to the repository root
    cfg = load_config(ROOT / "recipes" / "smollm2-135m.yaml")
    assert cfg.task.render == "chat"  # type: ignore[union-attr]  # auto, for a pretrained model
    task = build_task(cfg.task)
    train, held_out = task.samples("train"), task.samples("eval")
    assert len(train) == 500 and len(held_out) == 100
    sample = held_out[0]
    assert [m["role"] for m in sample.meta[PROMPT_MESSAGES]] == ["system", "user"]
    a, b, c = sample.meta["numbers"]
    best = str(max(a, b, c))
    assert task.reward(best, sample) == 1.0 and task.reward(f"The largest is {best}.", sample) == 1.0
    assert task.reward(f"The largest of {a}, {b} and {c} is {best}", sample) == 0.0  # restating the question
    assert task.reward(str(min(a, b, c)), sample) == 0.0 and task.reward("no idea", sample) == 0.0
