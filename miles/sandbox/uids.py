"""Dedicated unprivileged uids, one per live sandbox, for providers that run as root.

Why: a sandbox run as uid 0 (even with every capability dropped) still owns every root-owned file it can
see and is exempt from ``RLIMIT_NPROC``. Under its own uid a sandbox cannot touch host files that are
not world-writable, cannot signal other sandboxes, and ``RLIMIT_NPROC`` (counted per uid) is a second
fork-bomb fence next to the pids cgroup. One uid per *live* sandbox, because the count is per uid: two
sandboxes sharing a uid would share one process budget.

A uid is leased with an ``flock`` on ``<lock_dir>/<uid>``: leases are exclusive across every process on
the host, and a crashed process releases its leases with its file descriptors.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path


class UidLease:
    """An exclusive hold on one uid in ``[base, base + count)``; :meth:`release` (idempotent) gives it back."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, base: int, count: int, lock_dir: Path) -> UidLease:
        """Lease the lowest free uid (blocking: call in a thread). Lowest first keeps the lock files as few
        as the most sandboxes ever alive at once."""
        _private_dir(lock_dir)
        for uid in range(base, base + count):
            fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(uid, fd)
        raise OSError(f"all {count} sandbox uids from {base} are leased (raise uid_count)")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700) or check that an existing one is ours and not writable by others."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise OSError(f"{path}: uid lock directory must be a directory owned by uid {os.geteuid()}, mode 0700")
