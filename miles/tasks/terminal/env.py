"""``TerminalEnv``: a Harbor task played in a fresh sandbox, one shell command per turn, scored by its verifier.

An episode (see :mod:`miles.rollout.env` for the runner's side):

1. ``reset()`` creates the sandbox (work directory = a copy of the task's ``environment/``) and returns the
   instruction as the first user message, after an optional system message.
2. ``step(text)`` parses the turn (:mod:`miles.tasks.terminal.tools`), runs the command in the sandbox and
   returns its output as the next message; ``$ done`` ends the episode. A malformed turn gets an error
   message back and counts as a parse error.
3. ``reward()`` verifies: the task's ``tests/`` are mounted read-only at ``/tests`` and a fresh host
   directory read-write at ``/logs/verifier`` *for the verifier command only*, ``tests/test.sh`` runs, and the
   reward is read from the host side of that directory. The agent never saw the tests, and nothing it wrote
   or left running can stand in for the verifier's reward file (its processes died with its commands).

Time: the agent's commands are clamped to its budget (``limits.episode_timeout_s``, or the task's
``[agent] timeout_sec`` if shorter; past it a command is not run and reads ``[killed: episode_timeout]``);
the sandbox lives that long plus ``[verifier] timeout_sec``, so the verifier's time is never used up.

``step().info`` holds this step's counts (the runner sums them over the episode): ``tool_calls``,
``parse_errors``, ``env_s``, ``output_truncated``, ``commands_killed``.

Failures: a sandbox that does not start, a command the sandbox could not run, and a verifier that was
killed or wrote no readable reward raise :class:`miles.rollout.env.InfraError` (excluded from training,
never scored 0). Write ``test.sh`` so that it always writes a reward, 0 included, whatever the agent did.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import shutil
import stat
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

import structlog

from miles.rollout.env import ChatMessage, EnvStep, InfraError
from miles.sandbox.base import CommandResult, Mount, Sandbox, SandboxError, SandboxLimits, SandboxProvider
from miles.tasks.terminal.harbor import HarborTask
from miles.tasks.terminal.tools import Command, Finish, ParseError, format_observation, parse_action

log = structlog.get_logger(__name__)

TESTS_MOUNT = "/tests"
LOGS_MOUNT = "/logs/verifier"
REWARD_FILE_BYTES = 65536


class TerminalEnv:
    """One episode of one Harbor task (made fresh per episode; see the module docstring)."""

    def __init__(
        self,
        task: HarborTask,
        provider: SandboxProvider,
        limits: SandboxLimits,
        *,
        system_prompt: str | None = None,
        observation_chars: int = 1024,
        observation_role: Literal["user", "tool"] = "user",
    ) -> None:
        self.task = task
        self.provider = provider
        # The sandbox lives through the agent's time and then the verifier's: the agent's commands are
        # clamped to agent_s, so that the verifier's share is always left.
        self.agent_s = min(limits.episode_timeout_s, task.agent_timeout_s or math.inf)
        self.limits = replace(limits, episode_timeout_s=self.agent_s + task.verifier_timeout_s)
        self._agent_deadline = math.inf
        self.system_prompt = system_prompt
        self.observation_chars = observation_chars
        self.observation_role = observation_role
        self._sandbox: Sandbox | None = None
        self._finished = False
        self._reward: float | None = None
        self._closed = False

    async def reset(self) -> list[ChatMessage]:
        """Create the sandbox; the opening messages (system prompt if any, then the instruction)."""
        if self._sandbox is not None or self._closed:
            raise RuntimeError("TerminalEnv is used for one episode only")
        try:
            self._sandbox = await self.provider.create(self.limits, environment=self.task.environment)
        except SandboxError as exc:
            raise InfraError(f"task {self.task.name}: sandbox did not start: {exc}") from exc
        self._agent_deadline = time.monotonic() + self.agent_s
        messages: list[ChatMessage] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": self.task.instruction})
        return messages

    async def step(self, action: str) -> EnvStep:
        """Run the turn's command (or finish, or answer a malformed turn with an error message)."""
        sandbox = self._live()
        if self._finished:
            raise RuntimeError("step() after the episode finished")
        start = time.monotonic()
        parsed = parse_action(action)
        info = {"tool_calls": 0.0, "parse_errors": 0.0, "env_s": 0.0, "output_truncated": 0.0, "commands_killed": 0.0}
        if isinstance(parsed, Finish):
            self._finished = True
            info["env_s"] = time.monotonic() - start
            return EnvStep(done=True, end_reason="done", info=info)
        if isinstance(parsed, ParseError):
            info["parse_errors"] = 1.0
            info["env_s"] = time.monotonic() - start
            return EnvStep(messages=[self._observation(parsed.message)], info=info)
        assert isinstance(parsed, Command)
        left = self._agent_deadline - start
        try:
            if left <= 0:
                result = CommandResult(None, "", truncated=False, killed="episode_timeout", duration_s=0.0)
            else:
                result = await sandbox.run(parsed.command, timeout_s=min(self.limits.command_timeout_s, left))
        except SandboxError as exc:
            raise InfraError(f"task {self.task.name}: sandbox failed running a command: {exc}") from exc
        text, truncated = format_observation(result, self.observation_chars)
        info["tool_calls"] = 1.0
        info["output_truncated"] = float(truncated)
        info["commands_killed"] = float(result.killed is not None)
        info["env_s"] = time.monotonic() - start
        return EnvStep(messages=[self._observation(text)], info=info)

    async def reward(self) -> float:
        """Run the verifier once (whether the agent finished or a limit stopped it); its reward."""
        if self._reward is not None:
            return self._reward
        sandbox = self._live()
        tmp = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="miles-verify-"))
        try:
            tests = tmp / "tests"
            logs = tmp / "verifier"
            await asyncio.to_thread(_stage_tests, self.task.tests, tests, logs)
            exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in self.task.verifier_env.items())
            try:
                result = await sandbox.run(
                    f"{exports}{TESTS_MOUNT}/test.sh",
                    timeout_s=self.task.verifier_timeout_s,
                    mounts={TESTS_MOUNT: Mount(tests), LOGS_MOUNT: Mount(logs, writable=True)},
                )
            except SandboxError as exc:
                raise InfraError(f"task {self.task.name}: verifier could not run: {exc}") from exc
            log.debug("terminal.verifier", task=self.task.name, exit_code=result.exit_code, killed=result.killed)
            if result.killed is not None:
                raise InfraError(f"task {self.task.name}: verifier killed ({result.killed})")
            self._reward = await asyncio.to_thread(_read_reward, logs, self.task.name, result.output)
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
        return self._reward

    async def close(self) -> None:
        """Close the sandbox (kills what runs, deletes the work directory). Idempotent."""
        self._closed = True
        if self._sandbox is not None:
            sandbox, self._sandbox = self._sandbox, None
            await sandbox.close()

    def _live(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError("TerminalEnv: reset() first" if not self._closed else "TerminalEnv is closed")
        return self._sandbox

    def _observation(self, text: str) -> ChatMessage:
        return {"role": self.observation_role, "content": text}


def _stage_tests(source: Path, tests: Path, logs: Path) -> None:
    """Copy the task's tests readable for the sandbox's uid (the task folder may be private to us)."""
    shutil.copytree(source, tests, symlinks=False)
    for dirpath, _, filenames in os.walk(tests):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            executable = os.stat(path).st_mode & stat.S_IXUSR or name == "test.sh"
            os.chmod(path, 0o755 if executable else 0o644)
    logs.mkdir()


def _read_reward(logs: Path, task: str, output: str) -> float:
    """The reward in ``reward.txt`` (a number) or ``reward.json`` (``{"reward": x}``), read on the host.

    Opened without following symlinks: the verifier runs as the sandbox's uid and could have left one.
    """
    for name in ("reward.txt", "reward.json"):
        try:
            fd = os.open(logs / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise InfraError(f"task {task}: cannot open the verifier's {name}: {exc}") from exc
        with os.fdopen(fd, "rb") as handle:
            text = handle.read(REWARD_FILE_BYTES).decode("utf-8", errors="replace").strip()
        try:
            return _parse_reward(name, text)
        except ValueError as exc:
            raise InfraError(f"task {task}: verifier's {name} is not a reward: {exc}") from exc
    first = output.strip().splitlines()[:1]
    raise InfraError(f"task {task}: verifier wrote no reward file" + (f" ({first[0][:200]})" if first else ""))


def _parse_reward(name: str, text: str) -> float:
    if name == "reward.txt":
        return float(text)
    value = json.loads(text)
    if isinstance(value, dict):
        if "reward" in value:
            value = value["reward"]
        elif len(value) == 1:
            (value,) = value.values()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number or {{'reward': number}}, got {text[:80]!r}")
    return float(value)


async def replay(env: TerminalEnv, turns: Sequence[str]) -> tuple[list[ChatMessage], float]:
    """Play scripted assistant ``turns`` through ``env`` (reset, steps, reward, close): the whole conversation
    and the reward. For checking demonstrations and tasks against the real sandbox."""
    try:
        messages = await env.reset()
        for turn in turns:
            messages.append({"role": "assistant", "content": turn})
            step = await env.step(turn)
            messages.extend(step.messages)
            if step.done:
                break
        return messages, await env.reward()
    finally:
        await env.close()
