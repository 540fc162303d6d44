"""The built-in terminal family: deterministic, disjoint splits, short episodes, demonstrations that earn 1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles.rollout.env import EpisodeSpec
from miles.sandbox.base import SandboxLimits
from miles.tasks.terminal.builtin import PLACEHOLDER, check_demonstration, demonstrations, generate, solution, spec_of
from miles.tasks.terminal.config import BuiltinTerminalConfig, TerminalTaskConfig
from miles.tasks.terminal.env import TerminalEnv, replay
from miles.tasks.terminal.harbor import load_tasks
from miles.tasks.terminal.task import load_terminal_tasks, prepare_builtin
from tests.sandbox_support import bubblewrap_provider

SMALL = {"train_size": 40, "eval_size": 20}


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_generation_is_deterministic_by_seed(tmp_path: Path) -> None:
    cfg = BuiltinTerminalConfig(**SMALL, vary_names=True)
    generate(tmp_path / "a", cfg)
    generate(tmp_path / "b", cfg)
    generate(tmp_path / "c", cfg.model_copy(update={"seed": 1}))
    assert tree(tmp_path / "a") == tree(tmp_path / "b") != tree(tmp_path / "c")
    with pytest.raises(FileExistsError):
        generate(tmp_path / "a", cfg)


@pytest.mark.parametrize("disjoint_names", [False, True])
def test_train_and_eval_are_disjoint(tmp_path: Path, disjoint_names: bool) -> None:
    cfg = BuiltinTerminalConfig(train_size=300, eval_size=60, vary_names=True, disjoint_names=disjoint_names)
    dirs = generate(tmp_path, cfg)
    specs = {split: [spec_of(t) for t in load_tasks(path)] for split, path in dirs.items()}
    assert len(specs["train"]) == 300 and len(specs["eval"]) == 60
    assert not {s.value for s in specs["train"]} & {s.value for s in specs["eval"]}
    names = {split: {n for s in items for n in (s.source, s.target)} for split, items in specs.items()}
    assert bool(names["train"] & names["eval"]) is not disjoint_names


@pytest.mark.parametrize("transform", ["copy", "add", "reverse"])
def test_episodes_are_short(tmp_path: Path, transform: str) -> None:
    dirs = generate(tmp_path, BuiltinTerminalConfig(**SMALL, transform=transform, add=7, vary_names=True))
    for task in load_tasks(dirs["eval"]):
        conversation = demonstrations(task)
        assert len(task.instruction) <= 40
        assert sum(len(m["content"]) for m in conversation) < 150
        spec = spec_of(task)
        expected = {"copy": spec.value, "add": str(int(spec.value) + 7), "reverse": spec.value[::-1]}[transform]
        assert spec.answer == expected


@pytest.mark.parametrize("transform", ["copy", "add", "reverse"])
async def test_each_demonstration_earns_1_in_the_real_sandbox(tmp_path: Path, transform: str) -> None:
    provider = bubblewrap_provider()
    dirs = generate(tmp_path, BuiltinTerminalConfig(train_size=3, eval_size=3, transform=transform, vary_names=True))
    tasks = [t for path in dirs.values() for t in load_tasks(path)]
    rewards = await asyncio.gather(*(check_demonstration(t, provider, system_prompt="Shell.") for t in tasks))
    assert rewards == [1.0] * len(tasks)


async def test_a_wrong_answer_earns_0(tmp_path: Path) -> None:
    provider = bubblewrap_provider()
    task = load_tasks(generate(tmp_path, BuiltinTerminalConfig(train_size=1, eval_size=1))["eval"])[0]
    look, _, finish = solution(task)
    _, reward = await replay(TerminalEnv(task, provider, SandboxLimits()), [look, "$ echo 0 >a", finish])
    assert reward == 0.0


async def test_guessing_demonstrations_skip_the_look_and_earn_0(tmp_path: Path) -> None:
    """guess_fraction: that share of train tasks (none of eval) gets a warm-up demonstration that writes a
    placeholder without looking; replayed in the real sandbox it earns 0, the task's solution still 1."""
    provider = bubblewrap_provider()
    dirs = generate(tmp_path, BuiltinTerminalConfig(train_size=200, eval_size=20, guess_fraction=0.6))
    train, held_out = load_tasks(dirs["train"]), load_tasks(dirs["eval"])
    guessing = [t for t in train if spec_of(t).guess]
    assert 0.5 < len(guessing) / len(train) < 0.7 and not any(spec_of(t).guess for t in held_out)
    task = guessing[0]
    spec = spec_of(task)
    conversation = demonstrations(task)
    turns = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert turns == [f"$ echo {PLACEHOLDER} >{spec.target}", "$ done"] and spec.answer != PLACEHOLDER
    _, reward = await replay(TerminalEnv(task, provider, SandboxLimits()), turns)
    assert reward == 0.0
    assert await check_demonstration(task, provider) == 1.0
    plain = [t for t in train if not spec_of(t).guess][0]
    assert [m["content"] for m in demonstrations(plain) if m["role"] == "assistant"] == solution(plain)
    before = generate(tmp_path / "default", BuiltinTerminalConfig(train_size=200, eval_size=20))
    assert [spec_of(t).value for t in load_tasks(before["train"])] == [spec_of(t).value for t in train]


async def test_terminal_tasks_from_config(tmp_path: Path) -> None:
    provider = bubblewrap_provider()
    cfg = TerminalTaskConfig(builtin=BuiltinTerminalConfig(train_size=4, eval_size=2))
    tasks = load_terminal_tasks(cfg, provider, SandboxLimits(), builtin_dir=tmp_path / "builtin")
    again = load_terminal_tasks(cfg, provider, SandboxLimits(), builtin_dir=tmp_path / "builtin")  # reused
    assert (
        [s.id for s in tasks.samples("eval")]
        == [s.id for s in again.samples("eval")]
        == [
            "eval:eval-00000",
            "eval:eval-00001",
        ]
    )
    sample = tasks.samples("train")[0]
    env = tasks.environment(EpisodeSpec(sample.id, sample.prompt, sample.answer, sample.meta))
    _, reward = await replay(env, solution(env.task))
    assert reward == 1.0
    with pytest.raises(ValueError, match="another config"):
        prepare_builtin(BuiltinTerminalConfig(train_size=5, eval_size=2), tmp_path / "builtin")
    with pytest.raises(ValueError):
        TerminalTaskConfig()
