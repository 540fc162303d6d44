"""The sandbox interface: where an agent's shell commands run, one fresh sandbox per episode.

A :class:`SandboxProvider` makes sandboxes; a :class:`Sandbox` runs commands in a private writable work
directory over a read-only system, without network, under resource limits, and kills the whole process
tree of a command that overruns. The default provider is bubblewrap (:mod:`miles.sandbox.bubblewrap`);
others plug in by import path (``sandbox.provider: {type: import, factory: "pkg.mod:fn"}``, see
:mod:`miles.sandbox.registry`). Docker, E2B, Daytona or Modal fit behind the same five methods
(docs/agents.md).

Every method is a coroutine and never blocks the event loop: a provider runs its processes with
asyncio subprocesses (or threads).

Failures of the sandbox itself (it cannot start, its files cannot be copied) raise
:class:`SandboxError`, an infrastructure failure: the episode is marked ``infra_error`` and excluded from
training, never scored 0. What a *command* does (fails, times out, floods its output, forks without end)
is the agent's doing and comes back as a :class:`CommandResult`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol


class SandboxError(RuntimeError):
    """The sandbox could not be created or used (an infrastructure failure, not the agent's)."""


class SandboxUnavailable(SandboxError):
    """No sandbox of this provider can run on this machine; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits of one sandbox. Per command unless the name says episode."""

    command_timeout_s: float = 10.0  # wall clock; the whole process tree is killed past it
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS)
    processes: int = 64  # processes and threads alive at once in the sandbox (fork bombs stop here)
    file_size_mb: int = 16  # largest file a command may write (RLIMIT_FSIZE)
    output_bytes: int = 8192  # stdout+stderr kept per command (the rest is dropped, flagged truncated;
    # a command that prints more than max(1 MiB, 64x this) is killed: "output")
    episode_timeout_s: float = 600.0  # wall clock for everything run in one sandbox


@dataclass(frozen=True, slots=True)
class Mount:
    """A host directory bind-mounted into the sandbox for one command."""

    source: Path
    writable: bool = False


KillReason = Literal["timeout", "episode_timeout", "cpu", "memory", "processes", "file_size", "output"]


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What one command did. ``exit_code`` is None when it was killed (``killed`` says why)."""

    exit_code: int | None
    output: str  # stdout and stderr interleaved, decoded as UTF-8 with replacement, at most output_bytes
    truncated: bool  # output was longer than output_bytes
    killed: KillReason | None
    duration_s: float


class Sandbox(Protocol):
    """One episode's sandbox. Paths are relative to its work directory (absolute ones are refused)."""

    async def run(
        self, command: str, *, timeout_s: float | None = None, mounts: Mapping[str, Mount] | None = None
    ) -> CommandResult:
        """Run ``command`` with ``/bin/sh -c`` in the work directory (``timeout_s`` defaults to the limit).

        Each command is its own process tree: nothing it starts outlives it, so files are the only state
        that carries from one command to the next. ``mounts`` maps absolute sandbox paths to host
        directories visible to this command only (the verifier's tests read-only, a fresh directory for
        its reward file): an agent can neither read them before nor write them ahead of verification.
        """
        ...

    async def write_file(self, path: str, data: bytes) -> None:
        """Create or replace a file in the work directory (parents created)."""
        ...

    async def read_file(self, path: str) -> bytes:
        """A file of the work directory; :class:`FileNotFoundError` if absent."""
        ...

    async def copy_in(self, source: Path, dest: str) -> None:
        """Copy a host file or directory into the sandbox at ``dest`` (e.g. the tests, at verification)."""
        ...

    async def close(self) -> None:
        """Kill whatever still runs and delete the sandbox. Idempotent."""
        ...


class SandboxProvider(Protocol):
    """Makes sandboxes. ``check`` runs once at start-up; ``create`` once per episode."""

    def check(self) -> None:
        """Raise :class:`SandboxUnavailable` (one line) if no sandbox can be made here."""
        ...

    async def create(self, limits: SandboxLimits, *, environment: Path | None = None) -> Sandbox:
        """A fresh sandbox whose work directory starts as a copy of ``environment`` (a directory) or
        empty. Raises :class:`SandboxError` if it cannot be made."""
        ...
