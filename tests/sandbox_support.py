"""Shared helpers of the sandbox and terminal tests: the real bubblewrap provider, or a skip saying why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles.sandbox.base import SandboxUnavailable
from miles.sandbox.bubblewrap import BubblewrapProvider
from miles.sandbox.config import BubblewrapConfig

_PROVIDERS: dict[str, BubblewrapProvider] = {}


def bubblewrap_provider(**overrides: object) -> BubblewrapProvider:
    """A checked :class:`BubblewrapProvider` (cached per config); skips the test where none can start."""
    cfg = BubblewrapConfig(**overrides)
    key = cfg.model_dump_json()
    if key not in _PROVIDERS:
        provider = BubblewrapProvider(cfg)
        try:
            provider.check()
        except SandboxUnavailable as exc:
            pytest.skip(str(exc))
        _PROVIDERS[key] = provider
    return _PROVIDERS[key]


def host_pids_of_uid(uid: int) -> list[int]:
    """Host processes whose real uid is ``uid`` (what a sandbox could have left behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:  # exited while we looked
            continue
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        if int(uids[0]) == uid:
            found.append(int(entry.name))
    return found


def running_as_root() -> bool:
    return os.geteuid() == 0


def write_harbor_task(
    folder: Path,
    *,
    test_sh: str,
    instruction: str = "Write hi to out.",
    files: dict[str, str] | None = None,
    toml: str = "[verifier]\ntimeout_sec = 10.0\n",
) -> Path:
    """A Harbor task folder with ``files`` in environment/ and ``test_sh`` as the verifier."""
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "task.toml").write_text(toml)
    (folder / "instruction.md").write_text(instruction + "\n")
    for name, text in (files or {}).items():
        (folder / "environment" / name).write_text(text)
    (folder / "tests" / "test.sh").write_text(test_sh)
    (folder / "tests" / "test.sh").chmod(0o700)  # private to the host user: the env stages it readable
    return folder
