"""A cgroup ``pids`` controller per sandbox: the process limit that holds for root.

Root ignores ``RLIMIT_NPROC`` (the kernel exempts uid 0 and any holder of CAP_SYS_ADMIN or
CAP_SYS_RESOURCE), so a fork bomb run as root is stopped only by a cgroup: ``pids.max`` caps the processes
and threads alive in the group at once, for any uid, and ``pids.events`` counts the forks it refused, which
is how a provider tells a fork bomb from a command that merely failed. Works on cgroup v1 (a ``pids``
hierarchy) and v2 (a writable group whose parent delegates ``pids``); where neither is writable (an
unprivileged container, most non-root users) :func:`pids_root` says why and the provider falls back on
``RLIMIT_NPROC`` under an unprivileged uid.

The group is a directory under this process's own cgroup. Reads of its files are in-memory kernel files
(microseconds), so the provider polls ``pids.events`` from the event loop; creating and removing the group
run in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

REMOVE_TIMEOUT_S = 2.0


def _mountinfo_pids_roots() -> list[tuple[str, Path, str]]:
    """(version, mount point, root inside the hierarchy) of each mounted pids-capable cgroup hierarchy."""
    found: list[tuple[str, Path, str]] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, super_opts = tail[0], tail[2].split(",")
        if fstype == "cgroup" and "pids" in super_opts:
            found.append(("1", Path(fields[4]), fields[3]))
        elif fstype == "cgroup2":
            found.append(("2", Path(fields[4]), fields[3]))
    return found


def _own_cgroup(version: str) -> str | None:
    """This process's cgroup path in the v1 ``pids`` hierarchy or in the v2 hierarchy."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if version == "1" and "pids" in controllers.split(","):
            return path
        if version == "2" and hid == "0" and controllers == "":
            return path
    return None


def pids_root() -> tuple[Path | None, str]:
    """The directory under which this process may create pids groups, or None and the reason why not."""
    reasons: list[str] = []
    for version, mount, root in sorted(_mountinfo_pids_roots()):  # v1 first: it needs no delegation
        own = _own_cgroup(version)
        if own is None:
            continue
        rel = own[len(root) :] if root != "/" and own.startswith(root) else own
        base = mount / rel.lstrip("/")
        control = base / "cgroup.subtree_control"
        if version == "2" and (not control.exists() or "pids" not in control.read_text().split()):
            reasons.append(f"cgroup v2 group {base} does not delegate the pids controller")
            continue
        if not os.access(base, os.W_OK):
            reasons.append(f"{base} is not writable")
            continue
        return base, f"cgroup v{version} pids at {base}"
    return None, "; ".join(reasons) or "no pids cgroup hierarchy is mounted"


class PidsGroup:
    """One sandbox's pids cgroup: created with a limit, joined by each command, removed at close."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._refused_seen = 0

    @classmethod
    def create(cls, root: Path, limit: int) -> PidsGroup:
        """Make ``root/miles-sandbox-<id>`` with ``pids.max = limit`` (blocking: call in a thread)."""
        path = root / f"miles-sandbox-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        if not (path / "pids.max").exists():
            path.rmdir()
            raise OSError(f"{path} has no pids.max: the pids controller is not enabled there")
        (path / "pids.max").write_text(f"{limit}\n")
        group = cls(path)
        group._refused_seen = group.refused_forks()
        return group

    @property
    def procs_file(self) -> Path:
        """Write a pid here to move that process (and its future children) into the group."""
        return self.path / "cgroup.procs"

    def refused_forks(self) -> int:
        """How many forks ``pids.max`` refused so far (the ``max`` counter of ``pids.events``)."""
        for line in (self.path / "pids.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "max":
                return int(value)
        return 0

    def limit_hit(self) -> bool:
        """True once per refused batch: a fork was refused since the last call."""
        refused = self.refused_forks()
        hit = refused > self._refused_seen
        self._refused_seen = refused
        return hit

    def start_command(self) -> None:
        """Count refused forks from here on: those of an earlier command's processes, refused while they
        were being killed after its last :meth:`limit_hit`, are not the next command's."""
        self._refused_seen = self.refused_forks()

    def pids(self) -> list[int]:
        return [int(p) for p in self.procs_file.read_text().split()]

    def kill_all(self) -> None:
        """SIGKILL every process in the group (``cgroup.kill`` where the kernel has it)."""
        kill_file = self.path / "cgroup.kill"
        if kill_file.exists():
            kill_file.write_text("1\n")
            return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def empty(self, timeout_s: float = REMOVE_TIMEOUT_S) -> bool:
        """Kill what is left and wait until the group holds no process."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.path.exists() and self.pids():
            if loop.time() > deadline:
                return False
            self.kill_all()
            await asyncio.sleep(0.02)
        return True

    def remove_blocking(self, timeout_s: float = REMOVE_TIMEOUT_S) -> None:
        """:meth:`remove` for synchronous callers (start-up checks): kill, wait until empty, delete."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:  # EBUSY: tasks of the finished command are still being reaped
                if time.monotonic() > deadline:
                    log.warning("sandbox.cgroup_remove_failed", path=str(self.path), error=str(exc))
                    return
            self.kill_all()
            time.sleep(0.01)

    async def remove(self) -> None:
        """Empty and delete the group. Idempotent; a group that will not empty is logged and left."""
        if not self.path.exists():
            return
        if not await self.empty():
            log.warning("sandbox.cgroup_not_empty", path=str(self.path))
            return
        try:
            await asyncio.to_thread(self.path.rmdir)
        except FileNotFoundError:
            return
        except OSError as exc:  # EBUSY: a task still exiting; the empty directory costs nothing
            log.warning("sandbox.cgroup_remove_failed", path=str(self.path), error=str(exc))
