"""Run one host process under a wall-clock deadline with bounded output, without blocking the event loop.

This is the provider-independent half of a sandboxed command: a provider builds the argv (bwrap, ...)
and says how to tell a limit was hit; :func:`supervise` starts it as an asyncio subprocess in its own
session, reads stdout and stderr (one pipe, interleaved as the command wrote them) incrementally, keeping at
most ``output_bytes`` and draining the rest so the command never blocks on a full pipe, and on a deadline,
an output flood or a limit reported by ``watch`` kills the process group and lets the provider kill the
rest of the tree (``on_kill``: a cgroup; a pid namespace dies with its first process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from miles.sandbox.base import KillReason, SandboxError

log = structlog.get_logger(__name__)

CHUNK = 65536
EOF_GRACE_S = 2.0  # after the process exits, how long its pipes may take to close (a dying tree)
WATCH_INTERVAL_S = 0.05


@dataclass(slots=True)
class Outcome:
    """What the process did. ``returncode`` is as asyncio reports it (negative: killed by that signal)."""

    returncode: int
    output: bytes  # stdout and stderr, at most output_bytes
    truncated: bool  # the output was longer than output_bytes
    killed: KillReason | None  # set when supervise killed it, and why
    duration_s: float


class _Collector:
    """Reads a stream to EOF keeping the first ``keep`` bytes; stops early once ``flood`` bytes went by."""

    def __init__(self, stream: asyncio.StreamReader, keep: int, flood: int | None) -> None:
        self.stream = stream
        self.keep = keep
        self.flood = flood
        self.data = bytearray()
        self.total = 0
        self.flooded = False

    async def run(self) -> None:
        while True:
            chunk = await self.stream.read(CHUNK)
            if not chunk:
                return
            room = self.keep - len(self.data)
            if room > 0:
                self.data += chunk[:room]
            self.total += len(chunk)
            if self.flood is not None and self.total > self.flood:
                self.flooded = True
                return


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    """Write ``data`` to the process and close its stdin; a process that exits early just stops reading."""
    try:
        stdin.write(data)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        return
    finally:
        stdin.close()


async def _watch(check: Callable[[], KillReason | None]) -> KillReason:
    """Poll ``check`` until it reports a limit (a check that cannot read its source is a sandbox failure)."""
    while True:
        await asyncio.sleep(WATCH_INTERVAL_S)
        try:
            reason = check()
        except OSError as exc:
            raise SandboxError(f"cannot check the sandbox's limits: {exc}") from exc
        if reason is not None:
            return reason


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def supervise(
    argv: Sequence[str],
    *,
    timeout_s: float,
    timeout_reason: KillReason,
    output_bytes: int,
    flood_bytes: int | None,
    stdin: bytes | None = None,
    pass_fds: Sequence[int] = (),
    watch: Callable[[], KillReason | None] | None = None,
    on_kill: Callable[[], Awaitable[None]] | None = None,
) -> Outcome:
    """Run ``argv`` to completion or until a limit; see the module docstring.

    ``flood_bytes``: past this much stdout the process is killed (``killed="output"``), so that ``yes``
    cannot burn a core until its timeout. Raises :class:`SandboxError` if the process cannot be started.
    """
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            pass_fds=tuple(pass_fds),
            start_new_session=True,  # its own process group: one killpg reaches the launcher
        )
    except OSError as exc:
        raise SandboxError(f"cannot start {argv[0]}: {exc}") from exc
    assert proc.stdout is not None
    out = _Collector(proc.stdout, output_bytes, flood_bytes)
    tasks: list[asyncio.Task[object]] = [asyncio.create_task(out.run(), name="sandbox-output")]
    if stdin is not None:
        assert proc.stdin is not None
        tasks.append(asyncio.create_task(_feed(proc.stdin, stdin), name="sandbox-stdin"))
    waiter = asyncio.create_task(proc.wait(), name="sandbox-wait")
    watcher = asyncio.create_task(_watch(watch), name="sandbox-watch") if watch is not None else None
    killed: KillReason | None = None
    try:
        killed = await _until_exit(waiter, tasks[0], out, watcher, start + timeout_s, timeout_reason)
        if killed is not None:
            _kill_group(proc.pid)
            if on_kill is not None:
                await on_kill()
        returncode = await waiter
        # The tree is gone (or going): its pipes close within moments. Wait for that, bounded.
        finished, stuck = await asyncio.wait(tasks, timeout=EOF_GRACE_S)
        for task in finished:
            if task.exception() is not None:
                raise SandboxError(f"reading {argv[0]}'s pipes failed: {task.exception()}")
        if stuck:
            log.warning("sandbox.pipes_open_after_exit", argv0=argv[0], pending=len(stuck))
            if on_kill is not None:
                await on_kill()
    except BaseException:
        _kill_group(proc.pid)  # cancelled (episode over, close()): nothing may outlive the caller
        if on_kill is not None:
            await asyncio.shield(on_kill())
        raise
    finally:
        for task in (*tasks, waiter, watcher):
            if task is not None and not task.done():
                task.cancel()
    return Outcome(
        returncode=returncode,
        output=bytes(out.data),
        truncated=out.total > output_bytes,
        killed=killed,
        duration_s=time.monotonic() - start,
    )


async def _until_exit(
    waiter: asyncio.Task[int],
    reader: asyncio.Task[object],
    out: _Collector,
    watcher: asyncio.Task[KillReason] | None,
    deadline: float,
    timeout_reason: KillReason,
) -> KillReason | None:
    """Wait for the process to exit; return why it must be killed instead, if it must."""
    waitables: set[asyncio.Task[Any]] = {waiter, reader}
    if watcher is not None:
        waitables.add(watcher)
    while not waiter.done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return timeout_reason
        done, _ = await asyncio.wait(waitables, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if reader in done:
            if out.flooded:
                return "output"
            waitables.discard(reader)  # EOF: only the exit is left to wait for
        if watcher is not None and watcher in done:
            return watcher.result()
    return None
