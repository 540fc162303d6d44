"""A built-in family of terminal tasks small enough for a tiny character-level model, in the Harbor format.

Each task: a file (``v``) in the work directory holds a number; the agent must look at it and write a
transformed number to an answer file (``a``), then finish. A correct episode, observations included, is
about 80 characters::

    user       Write the number in v plus 3 to a.
    assistant  $ cat v
    user       472
    assistant  $ echo 475 >a
    user       [no output]
    assistant  $ done

Difficulty is tunable: ``transform`` (``copy``, ``add`` k, ``reverse`` the digits), ``digits`` of the
number, and ``vary_names`` (file names drawn per task, so the model must read them from the instruction).
Train and held-out tasks never share a number; with ``disjoint_names`` they never share a file name either.

With ``guess_fraction`` f, that share of the training tasks carries a *guessing* warm-up demonstration: it
writes a placeholder without looking (``$ echo 0 >a``, then ``$ done``) and would earn 0. A model warmed up
on that mix has the skill of the correct episode and the habit of answering without using the tool; what
RL has to learn from the verifier's reward is the multi-turn decision to look first (a classic agent
failure: answering before using the tool). The placeholder is one fixed digit, so the guesses teach no
digits that compete with the ones copied from an observation. The tasks themselves, the verifier and the
eval split do not change.

    python -m miles.tasks.terminal.builtin OUT_DIR   # writes OUT_DIR/train and OUT_DIR/eval, then checks
                                                     # that the first demonstrations earn reward 1
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from miles.rollout.env import ChatMessage
from miles.sandbox.base import SandboxLimits, SandboxProvider
from miles.tasks.terminal.config import BuiltinTerminalConfig
from miles.tasks.terminal.env import TerminalEnv, replay
from miles.tasks.terminal.harbor import HarborTask, load_tasks
from miles.tasks.terminal.tools import NO_OUTPUT

METADATA_KEY = "miles_builtin"
NAMES: str = "abcdefghijklmnopqrstuvwxyz"
PLACEHOLDER = "0"  # what a guessing demonstration writes: never an answer (answers have ``digits`` digits)


@dataclass(frozen=True, slots=True)
class BuiltinSpec:
    """What one generated task asks: read ``source`` (holding ``value``), write ``answer`` to ``target``."""

    source: str
    target: str
    value: str
    answer: str
    transform: str
    add: int
    guess: bool = False  # the warm-up demonstration writes PLACEHOLDER without looking

    def instruction(self) -> str:
        what = {
            "copy": f"Copy the number in {self.source} to {self.target}.",
            "add": f"Write the number in {self.source} plus {self.add} to {self.target}.",
            "reverse": f"Write the number in {self.source} reversed to {self.target}.",
        }
        return what[self.transform]


def _answer(value: str, cfg: BuiltinTerminalConfig) -> str:
    if cfg.transform == "copy":
        return value
    if cfg.transform == "add":
        return str(int(value) + cfg.add)
    return value[::-1]


def _names(cfg: BuiltinTerminalConfig) -> dict[str, str]:
    """The file-name pool of each split."""
    if not cfg.vary_names:
        return {"train": "va", "eval": "va"}
    if cfg.disjoint_names:
        return {"train": NAMES[:13], "eval": NAMES[13:]}
    return {"train": NAMES, "eval": NAMES}


def specs(cfg: BuiltinTerminalConfig) -> dict[str, list[BuiltinSpec]]:
    """The train and eval task specs, deterministic in ``cfg.seed``; eval numbers never appear in train."""
    rng = random.Random(cfg.seed)
    low, high = 10 ** (cfg.digits - 1), 10**cfg.digits - 1
    if cfg.eval_size >= high - low + 1:
        raise ValueError(f"builtin terminal tasks: {cfg.digits}-digit numbers cannot give {cfg.eval_size} eval values")
    eval_values = rng.sample(range(low, high + 1), cfg.eval_size)
    held = set(eval_values)
    train_pool = [v for v in range(low, high + 1) if v not in held]
    train_values = [rng.choice(train_pool) for _ in range(cfg.train_size)]
    names = _names(cfg)
    guesser = random.Random(cfg.seed + 1)  # its own stream: guess_fraction 0 leaves every task as before
    out: dict[str, list[BuiltinSpec]] = {}
    for split, values in (("train", train_values), ("eval", eval_values)):
        pool = names[split]
        out[split] = []
        for value in values:
            source, target = rng.sample(pool, 2) if cfg.vary_names else (pool[0], pool[1])
            text = str(value)
            guess = split == "train" and guesser.random() < cfg.guess_fraction
            out[split].append(BuiltinSpec(source, target, text, _answer(text, cfg), cfg.transform, cfg.add, guess))
    return out


def _task_toml(spec: BuiltinSpec, name: str) -> str:
    return (
        'version = "1.0"\n\n'
        f'[task]\nname = "{name}"\n\n'
        '[metadata]\ncategory = "miles-builtin"\n\n'
        f"[metadata.{METADATA_KEY}]\n"
        f'source = "{spec.source}"\ntarget = "{spec.target}"\nvalue = "{spec.value}"\n'
        f'answer = "{spec.answer}"\ntransform = "{spec.transform}"\nadd = {spec.add}\n'
        f"guess = {str(spec.guess).lower()}\n\n"
        "[verifier]\ntimeout_sec = 10.0\n\n[agent]\ntimeout_sec = 60.0\n"
    )


def _test_sh(spec: BuiltinSpec) -> str:
    # Runs in the work directory. Always writes a reward (0 included): no reward file is an infra error.
    return (
        "#!/bin/sh\n"
        f'if [ "$(cat ./{spec.target} 2>/dev/null)" = "{spec.answer}" ]; then r=1; else r=0; fi\n'
        "echo $r > /logs/verifier/reward.txt\n"
    )


def write_task(folder: Path, spec: BuiltinSpec) -> None:
    """Write one task folder (task.toml, instruction.md, environment/<source>, tests/test.sh)."""
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "task.toml").write_text(_task_toml(spec, folder.name))
    (folder / "instruction.md").write_text(spec.instruction() + "\n")
    (folder / "environment" / spec.source).write_text(spec.value + "\n")
    (folder / "tests" / "test.sh").write_text(_test_sh(spec))
    (folder / "tests" / "test.sh").chmod(0o755)


def generate(out_dir: Path, cfg: BuiltinTerminalConfig) -> dict[str, Path]:
    """Write ``out_dir/train/train-00000 ...`` and ``out_dir/eval/eval-00000 ...``; the two split directories.

    ``out_dir`` must not hold a previous generation (a stale folder would silently join a split).
    """
    out_dir = Path(out_dir)
    dirs = {split: out_dir / split for split in ("train", "eval")}
    for path in dirs.values():
        if path.exists():
            raise FileExistsError(f"{path} exists: generate into a fresh directory")
    for split, split_specs in specs(cfg).items():
        for k, spec in enumerate(split_specs):
            write_task(dirs[split] / f"{split}-{k:05d}", spec)
    return dirs


def spec_of(task: HarborTask) -> BuiltinSpec:
    """The spec a generated task was written from (:class:`KeyError` for a task not made here)."""
    meta = task.metadata[METADATA_KEY]
    return BuiltinSpec(
        source=meta["source"],
        target=meta["target"],
        value=meta["value"],
        answer=meta["answer"],
        transform=meta["transform"],
        add=int(meta["add"]),
        guess=bool(meta.get("guess", False)),  # folders written before guess_fraction existed
    )


def solution(task: HarborTask) -> list[str]:
    """The assistant turns of a correct episode: look, write, finish."""
    spec = spec_of(task)
    return [f"$ cat {spec.source}", f"$ echo {spec.answer} >{spec.target}", "$ done"]


def _conversation(
    task: HarborTask, turns: list[str], observations: list[str], system_prompt: str | None, role: str
) -> list[ChatMessage]:
    """The instruction, then each assistant turn followed by its observation (none after the last)."""
    messages: list[ChatMessage] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": task.instruction})
    for k, turn in enumerate(turns):
        messages.append({"role": "assistant", "content": turn})
        if k < len(observations):
            messages.append({"role": role, "content": observations[k]})
    return messages


def solution_conversation(
    task: HarborTask, *, system_prompt: str | None = None, role: str = "user"
) -> list[ChatMessage]:
    """The correct full conversation of ``task``, observations as :class:`TerminalEnv` renders them."""
    return _conversation(task, solution(task), [spec_of(task).value, NO_OUTPUT], system_prompt, role)


def demonstrations(task: HarborTask, *, system_prompt: str | None = None, role: str = "user") -> list[ChatMessage]:
    """The warm-up conversation of ``task`` (for SFT): the correct one, or for a task drawn by
    ``guess_fraction``, one that writes :data:`PLACEHOLDER` without looking.

    ``system_prompt`` and ``role`` (of observations) must match the env the model will be trained in.
    """
    spec = spec_of(task)
    if not spec.guess:
        return solution_conversation(task, system_prompt=system_prompt, role=role)
    turns = [f"$ echo {PLACEHOLDER} >{spec.target}", "$ done"]
    return _conversation(task, turns, [NO_OUTPUT], system_prompt, role)


async def check_demonstration(
    task: HarborTask,
    provider: SandboxProvider,
    limits: SandboxLimits | None = None,
    *,
    system_prompt: str | None = None,
) -> float:
    """Replay the :func:`solution` in the real sandbox; its reward (1.0 when the task is sound).

    Also raises :class:`AssertionError` if an observation differs from :func:`solution_conversation`'s: a
    model warmed up on demonstrations must see in RL exactly what it saw in SFT.
    """
    env = TerminalEnv(task, provider, limits or SandboxLimits(), system_prompt=system_prompt)
    messages, reward = await replay(env, solution(task))
    expected = solution_conversation(task, system_prompt=system_prompt)
    if messages != expected:
        raise AssertionError(f"task {task.name}: replayed conversation {messages} differs from {expected}")
    return reward


async def _main(out_dir: Path) -> None:  # pragma: no cover - a convenience entry point
    from miles.sandbox.registry import require_sandbox

    dirs = generate(out_dir, BuiltinTerminalConfig())
    provider = require_sandbox()
    for split, path in dirs.items():
        tasks = load_tasks(path)
        rewards = await asyncio.gather(*(check_demonstration(t, provider) for t in tasks[:8]))
        print(f"{split}: {len(tasks)} tasks in {path}; demonstration rewards {rewards}")


if __name__ == "__main__":  # pragma: no cover
    asyncio.run(_main(Path(sys.argv[1])))
