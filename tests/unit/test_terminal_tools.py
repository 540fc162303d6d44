"""The terminal tool-call format: parsing model turns and rendering command results."""

from __future__ import annotations

import pytest

from miles.sandbox.base import CommandResult
from miles.tasks.terminal.tools import NO_OUTPUT, Command, Finish, ParseError, format_observation, parse_action


@pytest.mark.parametrize(
    ("text", "command"),
    [
        ("$ cat v", "cat v"),
        ("$ echo 475 >a<eos>", "echo 475 >a"),
        ("  $   ls -la  \n", "ls -la"),
        ("I will look at the file.\n$ cat v\nThat should show it.", "cat v"),
        ("$\tpwd", "pwd"),
        ("$ echo '$ not a second call'", "echo '$ not a second call'"),
        ("$ cat v<|im_end|>\n$ rm -rf x", "cat v"),
    ],
)
def test_commands(text: str, command: str) -> None:
    assert parse_action(text) == Command(command)


@pytest.mark.parametrize("text", ["$ done", "$ done<eos>", "ok\n$ done\n"])
def test_finish(text: str) -> None:
    assert parse_action(text) == Finish()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "reply with one line"),
        ("cat v", "reply with one line"),
        ("$cat v", "reply with one line"),
        ("$HOME", "reply with one line"),
        ("\x00\x01garbage", "reply with one line"),
        ("$ ", "empty command"),
        ("$", "empty command"),
        ("$ ls\n$ cat v", "one command per turn"),
        ("$ echo a\x00b", "NUL"),
        ("$ " + "x" * 5000, "longer than"),
    ],
)
def test_malformed_turns_are_parse_errors(text: str, message: str) -> None:
    parsed = parse_action(text)
    assert isinstance(parsed, ParseError) and message in parsed.message
    assert len(parsed.message) < 50, "error observations stay short for a tiny model"


def _result(output: str = "", exit_code: int | None = 0, truncated: bool = False, killed: str | None = None):
    return CommandResult(exit_code=exit_code, output=output, truncated=truncated, killed=killed, duration_s=0.0)


def test_observations() -> None:
    assert format_observation(_result("472\n"), 100) == ("472", False)
    assert format_observation(_result(""), 100) == (NO_OUTPUT, False)
    assert format_observation(_result("no such file\n", exit_code=1), 100) == ("no such file\n[exit 1]", False)
    assert format_observation(_result("", exit_code=None, killed="timeout"), 100) == ("[killed: timeout]", False)
    assert format_observation(_result("y\n" * 10, truncated=True, exit_code=None, killed="output"), 100) == (
        "y\n" * 9 + "y\n[truncated]\n[killed: output]",
        True,
    )
    text, truncated = format_observation(_result("abcdefghij"), 4)
    assert (text, truncated) == ("abcd\n[truncated]", True)
