"""The host side of one sandbox: a private temp directory with the work directory and generated /etc files.

Layout: ``<state_dir>/miles-sandbox-XXXX/`` (mode 0700, the host's only) holding ``work/`` (bind-mounted
as the sandbox's work directory, owned by the sandbox's uid), ``etc/passwd`` and ``etc/group`` (so ``id`` and
``whoami`` name the sandbox user) and short-lived ``stage-*`` copies for :meth:`Workspace.stage`.

Host-side writes happen only into trees no agent has touched yet (a fresh work directory, a fresh stage):
once an agent ran, its work directory may hold symlinks aimed at host files, so later copies into it are
done *inside* the sandbox, as the sandbox's uid. Every method blocks: call it with ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import structlog

from miles.sandbox.uids import UidLease

log = structlog.get_logger(__name__)

# Docker build inputs: a bubblewrap sandbox runs on the host's own /usr and cannot build an image.
DOCKER_FILES: frozenset[str] = frozenset({"Dockerfile", "docker-compose.yaml", "docker-compose.yml", ".dockerignore"})


class Workspace:
    """One sandbox's host directory; :meth:`remove` (idempotent) deletes it and releases the uid."""

    def __init__(self, root: Path, uid: int, gid: int, lease: UidLease | None) -> None:
        self.root = root
        self.work = root / "work"
        self.etc = root / "etc"
        self.uid = uid
        self.gid = gid
        self._lease = lease
        self._stages = 0

    @classmethod
    def create(cls, state_dir: Path | None, workdir: str, uid_pool: tuple[int, int] | None) -> Workspace:
        """A fresh workspace; ``uid_pool`` = (base, count) leases a dedicated uid (as root), else our own uid."""
        base = state_dir or Path(tempfile.gettempdir())
        lease = None
        if uid_pool is not None:
            lease = UidLease.acquire(uid_pool[0], uid_pool[1], base / f"miles-sandbox-uids-{os.geteuid()}")
        uid, gid = (lease.uid, lease.uid) if lease else (os.getuid(), os.getgid())
        try:
            space = cls(Path(tempfile.mkdtemp(prefix="miles-sandbox-", dir=base)), uid, gid, lease)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        try:
            space.work.mkdir(mode=0o755)
            space.etc.mkdir(mode=0o755)
            (space.etc / "passwd").write_text(f"sandbox:x:{uid}:{gid}:sandbox:{workdir}:/bin/sh\n")
            (space.etc / "group").write_text(f"sandbox:x:{gid}:\n")
            for name in ("passwd", "group"):
                (space.etc / name).chmod(0o644)
            os.chown(space.work, uid, gid)
        except BaseException:
            space.remove()
            raise
        return space

    def fill(self, environment: Path) -> None:
        """Copy ``environment`` (a directory) into the fresh work directory, owned by the sandbox's uid."""
        if not environment.is_dir():
            raise NotADirectoryError(f"sandbox environment {environment} is not a directory")
        skipped = sorted(DOCKER_FILES & {p.name for p in environment.iterdir()})
        if skipped:
            log.debug("sandbox.docker_files_ignored", environment=str(environment), files=skipped)
        shutil.copytree(
            environment, self.work, symlinks=True, dirs_exist_ok=True, ignore=_top_level(environment, DOCKER_FILES)
        )
        self._own(self.work)

    def stage(self, source: Path) -> Path:
        """A copy of ``source`` readable by the sandbox's uid, for a read-only mount (caller deletes it)."""
        self._stages += 1
        dest = self.root / f"stage-{self._stages}"
        if source.is_dir():
            shutil.copytree(source, dest, symlinks=True)
        else:
            shutil.copy2(source, dest, follow_symlinks=True)
        _readable(dest)
        return dest

    def hand_over(self, path: Path) -> None:
        """Let the sandbox's uid write into ``path`` (the top directory of a writable mount)."""
        info = os.lstat(path)
        if (info.st_uid, info.st_gid) != (self.uid, self.gid):
            os.chown(path, self.uid, self.gid, follow_symlinks=False)

    def remove(self) -> None:
        if self.root.exists():
            shutil.rmtree(self.root, onerror=_unlock_and_retry)
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _own(self, top: Path) -> None:
        if (self.uid, self.gid) == (os.geteuid(), os.getegid()):
            return
        os.chown(top, self.uid, self.gid, follow_symlinks=False)
        for dirpath, dirnames, filenames in os.walk(top):
            for name in (*dirnames, *filenames):
                os.chown(os.path.join(dirpath, name), self.uid, self.gid, follow_symlinks=False)


def _top_level(root: Path, names: frozenset[str]) -> Callable[[str, list[str]], set[str]]:
    """A copytree ``ignore`` that drops ``names`` directly under ``root`` only."""

    def ignore(directory: str, entries: list[str]) -> set[str]:
        return names & set(entries) if Path(directory) == root else set()

    return ignore


def _readable(top: Path) -> None:
    """Make a staged tree world-readable (dirs 0755, files 0644, executables 0755); links are left alone."""
    paths = [top] + [Path(d) / n for d, dirs, files in os.walk(top) for n in (*dirs, *files)]
    for path in paths:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            continue
        executable = stat.S_ISDIR(info.st_mode) or info.st_mode & 0o100
        os.chmod(path, 0o755 if executable else 0o644)


def _unlock_and_retry(function: Callable[[str], object], path: str, exc_info: object) -> None:
    """rmtree's error hook: an agent may leave directories without write or search permission (non-root)."""
    parent = os.path.dirname(path)
    os.chmod(parent, 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
        shutil.rmtree(path, onerror=_unlock_and_retry)
    else:
        function(path)
