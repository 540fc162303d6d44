"""The bubblewrap sandbox, for real: bwrap, processes, cgroups and limits on this host (no mocks)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from miles.sandbox.base import Mount, SandboxError, SandboxLimits, SandboxUnavailable
from miles.sandbox.bubblewrap import BubblewrapProvider, BubblewrapSandbox
from miles.sandbox.config import BubblewrapConfig
from tests.sandbox_support import bubblewrap_provider, host_pids_of_uid, running_as_root

LIMITS = SandboxLimits(command_timeout_s=5.0, processes=32, output_bytes=1024, file_size_mb=1, episode_timeout_s=60)
HAS_PYTHON = shutil.which("python3", path="/usr/bin") is not None


@pytest.fixture
def provider() -> BubblewrapProvider:
    return bubblewrap_provider()


@pytest.fixture
async def sandbox(provider: BubblewrapProvider) -> AsyncIterator[BubblewrapSandbox]:
    box = await provider.create(LIMITS)
    yield box
    await box.close()


async def test_commands_share_files_not_processes(sandbox: BubblewrapSandbox) -> None:
    first = await sandbox.run("pwd; echo 42 > v; sleep 30 & echo started")
    assert (first.exit_code, first.output) == (0, "/app\nstarted\n")
    assert first.duration_s < 5, "a background process must not hold the command open"
    second = await sandbox.run("cat v; ls /proc | grep -c '^[0-9]'")
    # Only the new command's shell, grep and ls exist: the sleep died with the first command's namespace.
    assert second.output.splitlines()[0] == "42"
    assert int(second.output.splitlines()[1]) <= 4
    assert host_pids_of_uid(sandbox.space.uid) == [] or not running_as_root()


async def test_runs_unprivileged_with_a_clean_environment(sandbox: BubblewrapSandbox) -> None:
    result = await sandbox.run("id -u; id -un; echo $HOME; env | sort | cut -d= -f1 | tr '\\n' ' '")
    uid, name, home, env_names = result.output.splitlines()
    assert uid != "0" and name == "sandbox" and home == "/app"
    assert env_names.split() == sorted(["HOME", "LANG", "LOGNAME", "PATH", "PWD", "TERM", "TMPDIR", "USER"])
    caps = await sandbox.run("grep CapEff /proc/self/status")
    assert caps.output.split()[1] == "0000000000000000"


async def test_cannot_write_outside_the_work_directory(sandbox: BubblewrapSandbox, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("host\n")
    for target in ("/usr/x", "/x", "/etc/x", "/etc/passwd", str(victim), "/proc/sys/kernel/hostname"):
        result = await sandbox.run(f"echo pwned > {target}")
        assert result.exit_code != 0, target
    assert victim.read_text() == "host\n"
    tmp = await sandbox.run("echo scratch > /tmp/s && cat /tmp/s")
    assert tmp.output == "scratch\n"
    assert (await sandbox.run("cat /tmp/s")).exit_code != 0, "/tmp is private to one command"
    assert (await sandbox.run(f"ls {sandbox.space.root}")).exit_code != 0, "the host workspace is not visible"


@pytest.mark.skipif(not HAS_PYTHON, reason="needs /usr/bin/python3 to open sockets")
async def test_no_network(sandbox: BubblewrapSandbox) -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        probe = (
            "import socket\n"
            "for addr in [('127.0.0.1', %d), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
            "    s = socket.socket(); s.settimeout(1)\n"
            "    try: s.connect(addr); print('connected', addr)\n"
            "    except OSError as e: print('refused', e.errno)\n"
        ) % port
        await sandbox.write_file("probe.py", probe.encode())
        result = await sandbox.run("python3 probe.py; cat /proc/net/dev | tail -n +3 | cut -d: -f1")
    finally:
        server.close()
        await server.wait_closed()
    assert "connected" not in result.output
    assert result.output.count("refused") == 3
    assert result.output.split()[-1] == "lo", "only the loopback interface exists"


async def test_runaway_command_is_killed_by_its_timeout(sandbox: BubblewrapSandbox) -> None:
    start = time.monotonic()
    result = await sandbox.run("while true; do :; done", timeout_s=0.5)
    assert (result.exit_code, result.killed) == (None, "timeout")
    assert time.monotonic() - start < 3
    assert (await sandbox.run("echo alive")).output == "alive\n"


async def test_fork_bomb_is_stopped_by_the_process_limit(sandbox: BubblewrapSandbox) -> None:
    start = time.monotonic()
    result = await sandbox.run("bomb() { bomb | bomb & }; bomb; sleep 3")
    assert result.exit_code is None
    # With a pids cgroup the bomb is killed when the first fork is refused; without one, RLIMIT_NPROC
    # starves it and the command ends by its timeout. Either way the host is not swamped.
    assert result.killed == ("processes" if sandbox.group is not None else "timeout")
    if sandbox.group is not None:
        assert time.monotonic() - start < 2.5
    after = await sandbox.run("echo alive")
    assert (after.exit_code, after.output) == (0, "alive\n")


async def test_threads_count_against_the_process_limit(sandbox: BubblewrapSandbox) -> None:
    if not HAS_PYTHON:
        pytest.skip("needs /usr/bin/python3 to start threads")
    script = b"import threading, time\nthreading.stack_size(1 << 18)\n" + (
        b"for _ in range(100): threading.Thread(target=time.sleep, args=(0.3,)).start()\n"
    )
    await sandbox.write_file("threads.py", script)
    result = await sandbox.run("MALLOC_ARENA_MAX=1 python3 threads.py")  # small stacks: RLIMIT_AS is not the limit
    assert result.exit_code != 0
    if sandbox.group is not None:
        assert result.killed == "processes"


async def test_output_is_capped(sandbox: BubblewrapSandbox) -> None:
    big = await sandbox.run("head -c 5000 /dev/zero | tr '\\0' a; echo; echo tail")
    assert (big.exit_code, big.truncated, big.killed) == (0, True, None)
    assert big.output == "a" * LIMITS.output_bytes
    flood = await sandbox.run("yes")
    assert (flood.exit_code, flood.truncated, flood.killed) == (None, True, "output")
    assert flood.duration_s < 3, "a flood is killed, not drained until the timeout"
    small = await sandbox.run("echo ok >&2")
    assert (small.output, small.truncated) == ("ok\n", False)


async def test_file_size_limit(sandbox: BubblewrapSandbox) -> None:
    result = await sandbox.run("head -c 2000000 /dev/zero > big")
    assert result.killed == "file_size"
    assert (await sandbox.run("wc -c < big")).output.strip() == str(1 << 20)


@pytest.mark.slow
async def test_cpu_limit(provider: BubblewrapProvider) -> None:
    box = await provider.create(replace(LIMITS, cpu_s=1, command_timeout_s=20))
    try:
        result = await box.run("while :; do :; done")
    finally:
        await box.close()
    assert (result.exit_code, result.killed) == (None, "cpu")


@pytest.mark.skipif(not HAS_PYTHON, reason="needs /usr/bin/python3 to allocate")
async def test_memory_limit(provider: BubblewrapProvider) -> None:
    box = await provider.create(replace(LIMITS, memory_mb=128))
    try:
        result = await box.run("python3 -c 'x = bytearray(512 << 20)'")
    finally:
        await box.close()
    assert result.exit_code == 1 and "MemoryError" in result.output


async def test_episode_timeout(provider: BubblewrapProvider) -> None:
    box = await provider.create(replace(LIMITS, episode_timeout_s=1.5))
    try:
        first = await box.run("sleep 10")
        second = await box.run("echo late")
    finally:
        await box.close()
    assert first.killed == "episode_timeout" and first.duration_s < 3
    assert (second.killed, second.output) == ("episode_timeout", "")


async def test_mounts_are_visible_to_one_command_only(sandbox: BubblewrapSandbox, tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "secret").write_text("expected\n")
    out = tmp_path / "out"
    out.mkdir()
    mounts = {"/tests": Mount(tests), "/logs/verifier": Mount(out, writable=True)}
    result = await sandbox.run("cat /tests/secret; echo 1 > /logs/verifier/r; echo x > /tests/y", mounts=mounts)
    assert result.output.startswith("expected\n") and result.exit_code != 0, "the read-only mount refuses writes"
    assert (out / "r").read_text() == "1\n"
    later = await sandbox.run("cat /tests/secret; ls /logs")
    assert "expected" not in later.output and later.exit_code != 0


async def test_bad_paths_are_refused(sandbox: BubblewrapSandbox, tmp_path: Path) -> None:
    for path in ("/etc/passwd", "../x", "a/../../b", "", ".", "a\x00b"):
        with pytest.raises(ValueError):
            await sandbox.write_file(path, b"x")
        with pytest.raises(ValueError):
            await sandbox.read_file(path)
        with pytest.raises(ValueError):
            await sandbox.copy_in(tmp_path, path)
    for target in ("/app", "/app/tests", "/", "relative", "/usr/x", "/a/../app"):
        with pytest.raises(ValueError):
            await sandbox.run("true", mounts={target: Mount(tmp_path)})


async def test_file_operations_never_follow_agent_symlinks_to_the_host(
    sandbox: BubblewrapSandbox, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("host\n")
    await sandbox.run(f"ln -s {victim} link; mkdir -p d; ln -s {tmp_path} d/escape")
    with pytest.raises(SandboxError):
        await sandbox.write_file("link", b"pwned\n")  # the link dangles inside the sandbox
    with pytest.raises(FileNotFoundError):
        await sandbox.read_file("link")
    src = tmp_path / "src.txt"
    src.write_text("in\n")
    with pytest.raises(SandboxError):
        await sandbox.copy_in(src, "d/escape/victim")
    assert victim.read_text() == "host\n"


async def test_write_read_copy_in(sandbox: BubblewrapSandbox, tmp_path: Path) -> None:
    await sandbox.write_file("a/b/c.txt", b"\x00bin\xff")
    assert await sandbox.read_file("./a/b/c.txt") == b"\x00bin\xff"
    with pytest.raises(FileNotFoundError):
        await sandbox.read_file("missing")
    with pytest.raises(SandboxError):
        await sandbox.read_file("a")  # a directory
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("f\n")
    (tree / "run.sh").write_text("echo ran\n")
    (tree / "run.sh").chmod(0o700)
    (tree / "sub" / "f").chmod(0o600)  # host-private files are staged readable for the sandbox's uid
    await sandbox.copy_in(tree, "t")
    await sandbox.copy_in(tree / "sub" / "f", "single/f")
    result = await sandbox.run("cat t/sub/f single/f && ./t/run.sh && echo more >> t/sub/f")
    assert (result.exit_code, result.output) == (0, "f\nf\nran\n")


async def test_environment_is_copied_without_docker_files(provider: BubblewrapProvider, tmp_path: Path) -> None:
    env = tmp_path / "environment"
    (env / "data").mkdir(parents=True)
    (env / "data" / "v").write_text("7\n")
    (env / "Dockerfile").write_text("FROM ubuntu\n")
    box = await provider.create(LIMITS, environment=env)
    try:
        listing = await box.run("find . | sort; echo 8 > data/v")
    finally:
        await box.close()
    assert listing.output.split() == [".", "./data", "./data/v"]
    assert (env / "data" / "v").read_text() == "7\n", "the sandbox works on a copy"


async def test_close_kills_running_commands_and_removes_the_workspace(provider: BubblewrapProvider) -> None:
    box = await provider.create(LIMITS)
    running = asyncio.create_task(box.run("sleep 30"))
    await asyncio.sleep(0.2)
    start = time.monotonic()
    await box.close()
    await box.close()  # idempotent
    assert time.monotonic() - start < 3
    with pytest.raises(SandboxError, match="closed while a command ran"):
        await running
    assert not box.space.root.exists()
    if box.group is not None:
        assert not box.group.path.exists()
    with pytest.raises(SandboxError):
        await box.run("true")


async def test_a_sandbox_that_cannot_start_raises(provider: BubblewrapProvider, tmp_path: Path) -> None:
    box = await provider.create(LIMITS)
    try:
        with pytest.raises(SandboxError, match="could not start"):
            await box.run("true", mounts={"/tests": Mount(tmp_path / "missing")})
        assert (await box.run("echo fine")).output == "fine\n"
    finally:
        await box.close()
    with pytest.raises(SandboxError):
        await provider.create(LIMITS, environment=tmp_path / "missing")


def test_unusable_bwrap_is_unavailable_in_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bubblewrap 0.11.0'\nexit 1\n")
    fake.chmod(0o755)
    for path in (str(fake), str(tmp_path / "absent")):
        with pytest.raises(SandboxUnavailable) as info:
            BubblewrapProvider(BubblewrapConfig(bwrap=path)).check()
        assert "\n" not in str(info.value) and "bubblewrap sandbox unavailable" in str(info.value)


async def test_sandboxes_are_independent(provider: BubblewrapProvider) -> None:
    a, b = await asyncio.gather(provider.create(LIMITS), provider.create(LIMITS))
    try:
        await a.run("echo a > f")
        assert (await b.run("cat f")).exit_code != 0
        if running_as_root():
            assert a.space.uid != b.space.uid, "one uid per live sandbox"
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_fork_bomb_without_a_cgroup_is_starved_by_rlimit_nproc() -> None:
    provider = bubblewrap_provider(pids_cgroup="off")
    box = await provider.create(LIMITS)
    try:
        assert box.group is None
        bomb = await box.run("bomb() { bomb | bomb & }; bomb; sleep 0.5; echo survived", timeout_s=1.5)
        after = await box.run("echo alive")
    finally:
        await box.close()
    assert "Cannot fork" in bomb.output, "forks past the limit are refused"
    assert after.output == "alive\n"


_NON_ROOT_SCRIPT = """
import asyncio, sys
from miles.sandbox.base import SandboxLimits
from miles.sandbox.bubblewrap import BubblewrapProvider
async def main():
    provider = BubblewrapProvider()
    provider.check()
    assert not provider.launcher.as_root
    box = await provider.create(SandboxLimits(processes=16, command_timeout_s=1.5))
    try:
        ids = await box.run("id -u; echo x > f; cat f")
        bomb = await box.run("bomb() { bomb | bomb & }; bomb; sleep 0.3")
        after = await box.run("echo alive")
    finally:
        await box.close()
    print(ids.output.split()[0], "Cannot fork" in bomb.output, after.output.strip())
asyncio.run(main())
"""


@pytest.mark.skipif(not running_as_root(), reason="switches to an unprivileged uid to test the user-namespace mode")
def test_non_root_users_get_a_user_namespace_sandbox(tmp_path: Path) -> None:
    """The same provider run by an ordinary user: bwrap in a user namespace, RLIMIT_NPROC set inside it."""
    import subprocess
    import sys

    import miles

    system_python = Path("/usr/bin/python3")
    venv_site = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "pydantic").exists())
    version = subprocess.run([system_python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True)
    if not system_python.exists() or version.stdout.decode().strip() != str(sys.version_info[:2]):
        pytest.skip("needs a /usr/bin/python3 of this interpreter's version to import the venv as another user")
    repo = Path(miles.__file__).parent.parent
    tmp_path.chmod(0o777)
    env = {"PYTHONPATH": f"{repo}:{venv_site}", "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    user = ["setpriv", "--reuid=54321", "--regid=54321", "--clear-groups"]
    proc = subprocess.run(
        [*user, str(system_python), "-c", _NON_ROOT_SCRIPT], capture_output=True, text=True, env=env, timeout=60
    )
    if proc.returncode != 0 and "user namespace" in proc.stderr.lower():
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].split() == ["54321", "True", "alive"]
