"""Sandbox config models, the provider registry and the path rules (no sandbox is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from miles.sandbox.base import SandboxLimits, SandboxUnavailable
from miles.sandbox.bubblewrap import BubblewrapProvider
from miles.sandbox.config import BubblewrapConfig, ImportProviderConfig, SandboxConfig
from miles.sandbox.paths import mount_target, work_path
from miles.sandbox.registry import build_provider, require_sandbox


class _Provider:
    def __init__(self, label: str = "x") -> None:
        self.label = label
        self.checked = False

    def check(self) -> None:
        self.checked = True

    async def create(self, limits: SandboxLimits, *, environment: Path | None = None) -> object:
        raise NotImplementedError


def make_provider(label: str = "x") -> _Provider:
    return _Provider(label)


def make_nothing() -> object:
    return object()


def test_defaults_are_bubblewrap_with_the_base_limits() -> None:
    cfg = SandboxConfig()
    assert isinstance(cfg.provider, BubblewrapConfig)
    assert cfg.limits.to_limits() == SandboxLimits()
    assert isinstance(build_provider(cfg), BubblewrapProvider)


def test_config_is_strict() -> None:
    with pytest.raises(ValidationError):
        SandboxConfig.model_validate({"limits": {"timeout": 3}})
    with pytest.raises(ValidationError):
        SandboxConfig.model_validate({"provider": {"type": "docker"}})
    with pytest.raises(ValidationError, match="workdir"):
        BubblewrapConfig(workdir="/usr/app")
    with pytest.raises(ValidationError):
        SandboxConfig.model_validate({"limits": {"processes": 1}})


def test_import_provider_gets_its_options() -> None:
    cfg = SandboxConfig.model_validate(
        {"provider": {"type": "import", "factory": f"{__name__}:make_provider", "options": {"label": "mine"}}}
    )
    provider = require_sandbox(cfg)
    assert isinstance(provider, _Provider) and provider.label == "mine" and provider.checked


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("nocolon", "must have the form 'package.module:name'"),
        ("no_such_module_xyz:f", "cannot import"),
        (f"{__name__}:absent", "has no attribute"),
        (f"{__name__}:make_nothing", "lacks check, create"),
    ],
)
def test_bad_factories_are_one_line(factory: str, message: str) -> None:
    cfg = SandboxConfig(provider=ImportProviderConfig(factory=factory))
    with pytest.raises(SandboxUnavailable, match=message) as info:
        require_sandbox(cfg)
    assert "\n" not in str(info.value)


def test_work_paths() -> None:
    assert work_path("a/./b//c") == "a/b/c"
    assert work_path("./x") == "x"
    for bad in ("", "/abs", "../x", "a/../b", ".", "a\x00"):
        with pytest.raises(ValueError):
            work_path(bad)


def test_mount_targets() -> None:
    assert mount_target("/tests", "/app") == "/tests"
    assert mount_target("/logs/verifier", "/app") == "/logs/verifier"
    for bad in ("/", "tests", "/app", "/app/t", "/usr/t", "/etc", "/tmp/x", "/x/../app"):
        with pytest.raises(ValueError):
            mount_target(bad, "/app")
    with pytest.raises(ValueError):
        mount_target("/work", "/work/app")  # a mount above the work directory would hide it


def test_forks_refused_before_a_command_started_are_not_its_own(tmp_path: Path) -> None:
    """A fork bomb's last processes are refused forks while they are being killed, after the command's
    last poll; the next command (the verifier) must not be reported as a fork bomb for them."""
    from miles.sandbox.pids import PidsGroup

    events = tmp_path / "pids.events"
    events.write_text("max 3\n")
    group = PidsGroup(tmp_path)
    assert group.limit_hit()  # refused since the group was made
    events.write_text("max 9\n")  # the bomb's tail, refused after its command's last poll
    group.start_command()
    assert not group.limit_hit()
    events.write_text("max 10\n")
    assert group.limit_hit() and not group.limit_hit()
