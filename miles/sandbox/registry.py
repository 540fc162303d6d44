"""Build the sandbox provider a config names, and check it once at start-up.

``provider.type: bubblewrap`` (the default) is :class:`miles.sandbox.bubblewrap.BubblewrapProvider`;
``provider.type: import`` calls a user's factory ``"pkg.mod:fn"`` with ``provider.options`` as keyword
arguments. :func:`require_sandbox` is what a worker calls before its first episode: it builds the provider
and runs its ``check()``, so a host that cannot sandbox says so in one line and runs nothing unsandboxed.
"""

from __future__ import annotations

from miles.plugins import import_callable
from miles.sandbox.base import SandboxProvider, SandboxUnavailable
from miles.sandbox.config import BubblewrapConfig, ImportProviderConfig, SandboxConfig


def build_provider(cfg: SandboxConfig | BubblewrapConfig | ImportProviderConfig | None = None) -> SandboxProvider:
    """The provider for ``cfg`` (a whole :class:`SandboxConfig` or just its ``provider`` section)."""
    provider_cfg = cfg.provider if isinstance(cfg, SandboxConfig) else cfg or BubblewrapConfig()
    if provider_cfg.type == "bubblewrap":
        from miles.sandbox.bubblewrap import BubblewrapProvider

        return BubblewrapProvider(provider_cfg)
    factory = import_callable(provider_cfg.factory, "sandbox provider factory")
    provider = factory(**provider_cfg.options)
    missing = [name for name in ("check", "create") if not callable(getattr(provider, name, None))]
    if missing:
        raise ValueError(
            f"sandbox provider factory {provider_cfg.factory!r} returned {type(provider).__name__}, "
            f"which lacks {', '.join(missing)}()"
        )
    return provider


def require_sandbox(cfg: SandboxConfig | None = None) -> SandboxProvider:
    """Build and check the provider: :class:`SandboxUnavailable` (one line) if no sandbox can start here.

    A provider that is misconfigured (a bad import path) is unavailable too, for the same one-line report.
    """
    try:
        provider = build_provider(cfg)
    except ValueError as exc:
        raise SandboxUnavailable(str(exc)) from exc
    provider.check()
    return provider
