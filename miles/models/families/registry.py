"""The family registry: every module of this package that defines ``FAMILY`` is one family.

Discovery rather than a hand-kept list, so that adding a family is one module (plus its recipes); the
families found register in the one :class:`~miles.plugins.Registry`, which also takes a family of your own
by import path (a factory returning a :class:`ModelFamily`). The family modules import nothing heavy, so
the registry is cheap enough for config validation.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from miles.models.families.base import ModelFamily
from miles.plugins import PluginError, Registry

# Modules of the package that are infrastructure, not families.
_NOT_FAMILIES = frozenset({"base", "build", "config", "registry", "rules", "tokenizer"})

# A family name that no module defines (a ValueError, so pydantic reports it as a config error).
UnknownFamilyError = PluginError


@cache
def _families() -> Registry[ModelFamily]:
    """Every family module's ``FAMILY``, registered under its name (``factory() -> ModelFamily``)."""
    import miles.models.families as package

    families: Registry[ModelFamily] = Registry("model family")
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name in _NOT_FAMILIES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if isinstance(family, ModelFamily):
            families.register(family.name)(lambda family=family: family)  # twice: "registered twice"
    return families


def family_names() -> list[str]:
    """Names of every registered family, sorted."""
    return sorted(_families().names)


def get_family(name: str) -> ModelFamily:
    """The family called ``name``, or the one a factory at import path ``name`` returns (``package.module:name``,
    docs/models.md); :class:`UnknownFamilyError` names the known ones otherwise."""
    family = _families().factory(name)()
    if not isinstance(family, ModelFamily):
        raise PluginError(f"model family {name!r} is a {type(family).__name__}, not a ModelFamily")
    return family


def family_of(model_cfg: object) -> str | None:
    """The family name of a ``model:`` section of ``type: family``; None for any other model type (the
    generic rules then apply, e.g. to which tensors rollout quantization touches)."""
    return getattr(model_cfg, "family", None) if getattr(model_cfg, "type", None) == "family" else None
