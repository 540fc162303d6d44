"""Registries of the algorithm layer: built-in pieces by name, a user's own by import path.

Every pluggable piece of the objective (advantage estimator, policy loss, off-policy correction) is
chosen by the ``type`` of its config section. Built-ins register themselves under their name; ``type:
custom`` with ``path: package.module:factory`` imports the user's factory, which is called with the
section's config and must return an object of the same protocol.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class AlgoConfigError(ValueError):
    """A config section names an unknown piece or an import path that does not resolve."""


def import_object(spec: str, what: str) -> Any:
    """``'package.module:attr'`` (``attr`` may be dotted) -> the object; one-line errors naming ``what``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AlgoConfigError(f"{what} {spec!r} must have the form 'package.module:name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise AlgoConfigError(f"{what} {spec!r}: cannot import module {module_name!r} ({exc})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AlgoConfigError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


class Registry(Generic[T]):
    """Factories by name: ``factory(config) -> T``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[[Any], T]] = {}

    def register(self, name: str) -> Callable[[Callable[[Any], T]], Callable[[Any], T]]:
        def decorate(factory: Callable[[Any], T]) -> Callable[[Any], T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            return factory

        return decorate

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def build(self, cfg: Any) -> T:
        """The piece for a config section (``cfg.type``; ``custom`` imports ``cfg.path``)."""
        kind = cfg.type
        if kind == "custom":
            factory = import_object(cfg.path, f"{self.kind} path")
            if not callable(factory):
                raise AlgoConfigError(f"{self.kind} path {cfg.path!r} is not callable")
            return factory(cfg)
        factory = self._factories.get(kind)
        if factory is None:
            raise AlgoConfigError(f"unknown {self.kind} {kind!r}; known: {', '.join(self.names)} or custom")
        return factory(cfg)
