"""TerminalEnv end to end in the real bubblewrap sandbox: episodes, limits, verification, failures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles.rollout.env import InfraError
from miles.sandbox.base import SandboxLimits
from miles.sandbox.bubblewrap import BubblewrapProvider
from miles.sandbox.config import BubblewrapConfig
from miles.tasks.terminal.env import TerminalEnv, replay
from miles.tasks.terminal.harbor import HarborTask, load_task
from tests.sandbox_support import bubblewrap_provider, write_harbor_task

LIMITS = SandboxLimits(command_timeout_s=1.0, processes=32, output_bytes=2048, episode_timeout_s=60)

CHECK_OUT = """#!/bin/sh
# A verifier that keeps a secret from the agent.
SECRET=the-expected-answer-is-hi
if [ "$(cat out 2>/dev/null)" = "hi" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


@pytest.fixture
def provider() -> BubblewrapProvider:
    return bubblewrap_provider()


@pytest.fixture
def task(tmp_path: Path) -> HarborTask:
    return load_task(write_harbor_task(tmp_path / "hello", test_sh=CHECK_OUT, files={"notes.txt": "say hi\n"}))


def env_of(task: HarborTask, provider: BubblewrapProvider, **kwargs: object) -> TerminalEnv:
    return TerminalEnv(task, provider, LIMITS, **kwargs)


async def test_a_solved_episode_scores_1_and_a_wrong_one_0(task: HarborTask, provider: BubblewrapProvider) -> None:
    env = env_of(task, provider, system_prompt="You are in a shell.")
    messages, reward = await replay(env, ["$ cat notes.txt", "$ echo hi > out", "$ done"])
    assert reward == 1.0
    assert messages == [
        {"role": "system", "content": "You are in a shell."},
        {"role": "user", "content": "Write hi to out."},
        {"role": "assistant", "content": "$ cat notes.txt"},
        {"role": "user", "content": "say hi"},
        {"role": "assistant", "content": "$ echo hi > out"},
        {"role": "user", "content": "[no output]"},
        {"role": "assistant", "content": "$ done"},
    ]
    _, wrong = await replay(env_of(task, provider), ["$ echo bye > out", "$ done"])
    assert wrong == 0.0


async def test_step_info_and_observations(task: HarborTask, provider: BubblewrapProvider) -> None:
    env = env_of(task, provider, observation_chars=100, observation_role="tool")
    try:
        await env.reset()
        ok = await env.step("$ ls")
        assert (ok.messages, ok.done) == ([{"role": "tool", "content": "notes.txt"}], False)
        assert ok.info["tool_calls"] == 1 and ok.info["parse_errors"] == 0 and ok.info["env_s"] > 0
        garbage = await env.step("let me think about it")
        assert garbage.info["parse_errors"] == 1 and garbage.info["tool_calls"] == 0
        assert garbage.messages[0]["content"].startswith("error:") and not garbage.done
        failing = await env.step("$ cat nope")
        assert failing.messages[0]["content"].endswith("[exit 1]")
        flood = await env.step("$ head -c 100000 /dev/zero | tr '\\0' x")
        assert flood.info["output_truncated"] == 1 and len(flood.messages[0]["content"]) <= 100 + len("\n[truncated]")
        done = await env.step("$ done")
        assert (done.done, done.end_reason, done.messages) == (True, "done", [])
        with pytest.raises(RuntimeError):
            await env.step("$ ls")
    finally:
        await env.close()
        await env.close()


async def test_runaway_and_fork_bomb_are_killed_and_the_episode_goes_on(
    task: HarborTask, provider: BubblewrapProvider
) -> None:
    env = env_of(task, provider)
    try:
        await env.reset()
        spin = await env.step("$ while true; do :; done")
        assert spin.messages[0]["content"] == "[killed: timeout]" and spin.info["commands_killed"] == 1
        bomb = await env.step("$ bomb() { bomb | bomb & }; bomb; sleep 5")
        assert bomb.info["commands_killed"] == 1
        assert bomb.messages[0]["content"].endswith("[killed: processes]" if provider.launcher.pids else "timeout]")
        flood = await env.step("$ yes")
        assert flood.messages[0]["content"].endswith("[truncated]\n[killed: output]")
        assert (await env.step("$ echo hi > out")).messages[0]["content"] == "[no output]"
        assert await env.reward() == 1.0
    finally:
        await env.close()


async def test_the_agent_cannot_read_the_tests_before_verification(
    task: HarborTask, provider: BubblewrapProvider
) -> None:
    env = env_of(task, provider)
    try:
        await env.reset()
        seen = []
        for command in (
            "ls -la / /tests /logs",
            "find / -path /usr -prune -o -path /proc -prune -o -name test.sh -print",
            f"cat {task.tests}/test.sh",
        ):
            seen.append((await env.step(f"$ {command}")).messages[0]["content"])
        await env.step("$ echo hi > out")
        assert await env.reward() == 1.0
    finally:
        await env.close()
    assert not any("the-expected-answer" in text for text in seen)
    assert not any("test.sh" in text for text in seen[1:2])


async def test_the_agent_cannot_forge_the_reward(tmp_path: Path, provider: BubblewrapProvider) -> None:
    always_zero = "#!/bin/sh\necho 0 > /logs/verifier/reward.txt\n"
    task = load_task(write_harbor_task(tmp_path / "zero", test_sh=always_zero))
    env = env_of(task, provider)
    forgeries = [
        "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt",
        "mkdir -p logs/verifier; echo 1 > logs/verifier/reward.txt; echo 1 > reward.txt; echo 1 > /tmp/reward.txt",
        "(while :; do echo 1 > /logs/verifier/reward.txt; echo 1 > reward.txt; sleep 0.01; done) >/dev/null 2>&1 &",
        "nohup sh -c 'sleep 1; echo 1 > /logs/verifier/reward.txt' >/dev/null 2>&1 &",
        "ln -s /proc/self/fd/1 reward.json; mkdir -p tests; echo 'echo 1 > /logs/verifier/reward.txt' > tests/test.sh",
    ]
    try:
        await env.reset()
        for command in forgeries:
            await env.step(f"$ {command}")
        assert await env.reward() == 0.0
    finally:
        await env.close()


async def test_verifier_failures_are_infra_errors(tmp_path: Path, provider: BubblewrapProvider) -> None:
    cases = {
        "silent": ("#!/bin/sh\necho crashed; exit 3\n", "[verifier]\ntimeout_sec = 5.0\n", "no reward file (crashed)"),
        "hangs": ("#!/bin/sh\nsleep 30\n", "[verifier]\ntimeout_sec = 0.5\n", "verifier killed (timeout)"),
        "garbage": ("#!/bin/sh\necho lots > /logs/verifier/reward.txt\n", "", "not a reward"),
        "badjson": ('#!/bin/sh\necho \'{"a": 1, "b": 2}\' > /logs/verifier/reward.json\n', "", "not a reward"),
    }
    for name, (test_sh, toml, message) in cases.items():
        task = load_task(write_harbor_task(tmp_path / name, test_sh=test_sh, toml=toml))
        env = env_of(task, provider)
        try:
            await env.reset()
            with pytest.raises(InfraError, match=re.escape(message)):
                await env.reward()
        finally:
            await env.close()


async def test_reward_json_and_verifier_env(tmp_path: Path, provider: BubblewrapProvider) -> None:
    test_sh = '#!/bin/sh\necho "{\\"reward\\": $WEIGHT, \\"extra\\": 1}" > /logs/verifier/reward.json\n'
    toml = '[verifier]\ntimeout_sec = 5.0\nenv = { WEIGHT = "0.25" }\n'
    task = load_task(write_harbor_task(tmp_path / "json", test_sh=test_sh, toml=toml))
    _, reward = await replay(env_of(task, provider), ["$ done"])
    assert reward == 0.25


async def test_a_sandbox_that_cannot_start_is_an_infra_error(task: HarborTask, tmp_path: Path) -> None:
    broken = BubblewrapProvider(BubblewrapConfig(bwrap=str(tmp_path / "no-bwrap")))
    with pytest.raises(InfraError, match="sandbox did not start: bubblewrap sandbox unavailable"):
        await env_of(task, broken).reset()
    missing_env = HarborTask(
        name="ghost",
        path=tmp_path,
        instruction="x",
        environment=tmp_path / "gone",
        tests=task.tests,
        verifier_timeout_s=5.0,
        agent_timeout_s=None,
    )
    env = env_of(missing_env, bubblewrap_provider())
    with pytest.raises(InfraError, match="ghost: sandbox did not start"):
        await env.reset()
    await env.close()


async def test_the_sandbox_outlives_the_agent_budget_by_the_verifier_timeout(
    tmp_path: Path, provider: BubblewrapProvider
) -> None:
    toml = "[agent]\ntimeout_sec = 1.0\n[verifier]\ntimeout_sec = 5.0\n"
    task = load_task(write_harbor_task(tmp_path / "slow", test_sh=CHECK_OUT, toml=toml))
    env = env_of(task, provider)
    assert env.limits.episode_timeout_s == 6.0
    try:
        await env.reset()
        await env.step("$ echo hi > out")
        slow = await env.step("$ sleep 5")  # runs into the agent's 1 s
        late = await env.step("$ echo more")
        assert await env.reward() == 1.0, "the verifier's 5 s are still there"
    finally:
        await env.close()
    assert slow.messages[0]["content"] == "[killed: timeout]"
    assert late.messages[0]["content"] == "[killed: episode_timeout]" and late.info["commands_killed"] == 1


async def test_the_docs_worked_example(tmp_path: Path, provider: BubblewrapProvider) -> None:
    """docs/agents.md's count-lines task, file for file."""
    folder = write_harbor_task(
        tmp_path / "count-lines",
        instruction="Count the lines of log.txt and write the number to count.txt.",
        files={"log.txt": "boot\nready\nshutdown\n"},
        toml='version = "1.0"\n\n[task]\nname = "count-lines"\n\n[agent]\ntimeout_sec = 120.0\n\n'
        "[verifier]\ntimeout_sec = 30.0\n",
        test_sh="#!/bin/sh\n"
        'if [ "$(tr -d \' \\n\' < count.txt 2>/dev/null)" = "$(cat /tests/expected)" ]; then r=1; else r=0; fi\n'
        "echo $r > /logs/verifier/reward.txt\n",
    )
    (folder / "tests" / "expected").write_text("3\n")
    task = load_task(folder)
    _, reward = await replay(TerminalEnv(task, provider, SandboxLimits()), ["$ wc -l < log.txt > count.txt", "$ done"])
    assert reward == 1.0
    _, wrong = await replay(TerminalEnv(task, provider, SandboxLimits()), ["$ echo 4 > count.txt", "$ done"])
    assert wrong == 0.0
