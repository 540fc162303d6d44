"""The plugin seam: built-in variants by name, a user's own by import path, through one registry.

Every pluggable kind (task, advantage estimator, policy loss, off-policy correction, sandbox provider, ...)
has one :class:`Registry`. Built-ins register a factory under their name; a config names a user's class or
factory by import path instead, ``package.module:attr`` (``attr`` may be dotted), resolved by
:func:`import_object`, the one resolver in Miles. The working directory is importable (after everything
else on ``sys.path``, so a local file never shadows an installed module): the processes ``miles run`` starts
inherit its directory, so a module next to the recipe needs no ``PYTHONPATH``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PluginError(ValueError):
    """A config names an unknown variant or an import path that does not resolve (one line)."""


def is_import_path(name: str) -> bool:
    """Whether a config's ``type`` names a user's object (``package.module:attr``) rather than a built-in."""
    return ":" in name


def importable_cwd() -> None:
    """Make the working directory importable, after every other entry of ``sys.path``. Idempotent."""
    directory = os.getcwd()
    if directory not in sys.path and "" not in sys.path:
        sys.path.append(directory)


def import_module(name: str, what: str) -> Any:
    """Import module ``name`` (on ``sys.path`` or in the working directory); :class:`PluginError` naming ``what``
    (if given) otherwise."""
    importable_cwd()
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        where = f"{what}: " if what else ""
        raise PluginError(
            f"{where}cannot import module {name!r} ({exc}); modules are found on sys.path and in the working "
            f"directory {os.getcwd()}"
        ) from None


def import_object(path: str, what: str) -> Any:
    """``'package.module:attr'`` -> the object; :class:`PluginError` naming ``what`` and the path otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"{what} {path!r} must have the form 'package.module:name'")
    obj = import_module(module_name, f"{what} {path!r}")
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def import_callable(path: str, what: str) -> Callable[..., Any]:
    obj = import_object(path, what)
    if not callable(obj):
        raise PluginError(f"{what} {path!r}: {path.partition(':')[2]!r} is not callable (a {type(obj).__name__})")
    return obj


def source_digest(path: str) -> str | None:
    """SHA-256 of the source file of the module ``path`` (``package.module:attr``) names, for cache keys: an
    edited environment or reward must not reuse a model warmed up on the old one. None if no source file is
    found (the module does not exist: building the task says so)."""
    importable_cwd()
    try:
        spec = importlib.util.find_spec(path.partition(":")[0])
    except (ImportError, ValueError):  # a parent package that does not import
        return None
    origin = spec.origin if spec is not None else None
    if origin is None or not os.path.isfile(origin):
        return None
    with open(origin, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


Factory = Callable[..., T]


class Registry(Generic[T]):
    """Factories of one kind by name (``factory(config, ...) -> T``), or a user's by import path.

    ``by_path=False``: names only, for a kind whose name travels in messages and the run info (a weight
    transport, a sync mode); a user's is registered by name from a module the recipe's ``plugins`` imports."""

    def __init__(self, kind: str, *, by_path: bool = True) -> None:
        self.kind = kind
        self.by_path = by_path
        self._factories: dict[str, Factory[T]] = {}

    def register(self, name: str) -> Callable[[Factory[T]], Factory[T]]:
        def decorate(factory: Factory[T]) -> Factory[T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            return factory

        return decorate

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def factory(self, name: str) -> Factory[T]:
        """The factory registered as ``name``, or the callable at import path ``name``."""
        if is_import_path(name) and self.by_path:
            return import_callable(name, self.kind)
        factory = self._factories.get(name)
        if factory is None:
            own = (
                "or 'package.module:name' of your own"
                if self.by_path
                else "or one of your own, registered from a module in the recipe's plugins"
            )
            raise PluginError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names)}, {own}")
        return factory

    def build(self, cfg: Any) -> T:
        """The piece for a config section: ``factory(cfg)`` of ``cfg.type`` (the algorithm sections' ``type:
        custom`` names its import path in ``path``)."""
        return self.factory(cfg.path if cfg.type == "custom" else cfg.type)(cfg)
