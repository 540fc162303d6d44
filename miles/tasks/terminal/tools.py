"""The terminal tool-call format: one shell command per turn, as a line ``$ <command>``.

Chosen to be learnable by a 100k-parameter character-level model and cheap for a large one:

* A turn runs a command when it has exactly one line that starts with ``$ `` (leading spaces allowed):
  ``$ cat v``. The command is the rest of that line. Other lines (reasoning, a preamble) are ignored.
* ``$ done`` ends the episode (``done`` is a shell keyword, so it can never be a real command on its own).
* Text from the first end marker on (``<eos>``, ``<|im_end|>``, ...) is ignored.
* Anything else is a parse error: the environment answers with a short error observation and counts it
  (``parse_errors``); it is never an exception.

Observations are the command's output (stdout and stderr interleaved), cut to a character cap, with
trailing newlines removed and short notes appended: ``[exit 2]``, ``[killed: timeout]``, ``[truncated]``;
``[no output]`` when there is nothing else to say.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.sandbox.base import CommandResult
from miles.tasks.base import END_MARKERS

PREFIX = "$ "
FINISH = "done"
MAX_COMMAND_CHARS = 4096
TOOL_HELP = "Reply with one line: $ <shell command>. Reply $ done when finished."
NO_OUTPUT = "[no output]"


@dataclass(frozen=True, slots=True)
class Command:
    """Run this shell command."""

    command: str


@dataclass(frozen=True, slots=True)
class Finish:
    """The agent says it is done."""


@dataclass(frozen=True, slots=True)
class ParseError:
    """The turn is not a valid tool call; ``message`` is the observation the agent gets back."""

    message: str


Action = Command | Finish | ParseError


def parse_action(text: str, *, max_chars: int = MAX_COMMAND_CHARS) -> Action:
    """Parse one model turn (decoded text) into a command, a finish, or a parse error (never raises)."""
    for marker in END_MARKERS:
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    calls = []
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped == "$" or stripped.startswith(("$ ", "$\t")):
            calls.append(stripped[1:].strip())
    if not calls:
        return ParseError("error: reply with one line $ <command>")
    if len(calls) > 1:
        return ParseError("error: one command per turn")
    command = calls[0]
    if not command:
        return ParseError("error: empty command")
    if command == FINISH:
        return Finish()
    if "\x00" in command:
        return ParseError("error: NUL in command")
    if len(command) > max_chars:
        return ParseError(f"error: command longer than {max_chars} chars")
    return Command(command)


def format_observation(result: CommandResult, max_chars: int) -> tuple[str, bool]:
    """The observation text for ``result`` and whether it was truncated (by the sandbox or by ``max_chars``)."""
    body = result.output
    cut = len(body) > max_chars
    if cut:
        body = body[:max_chars]
    body = body.rstrip("\n")
    truncated = cut or result.truncated
    notes = []
    if truncated:
        notes.append("[truncated]")
    if result.killed is not None:
        notes.append(f"[killed: {result.killed}]")
    elif result.exit_code not in (0, None):
        notes.append(f"[exit {result.exit_code}]")
    text = "\n".join([body, *notes] if body else notes)
    return text or NO_OUTPUT, truncated
