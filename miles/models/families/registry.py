"""The family registry: every module of this package that defines ``FAMILY`` is one family.

Discovery rather than a hand-kept list, so that adding a family is one module (plus its recipes). The
family modules import nothing heavy, so the registry is cheap enough for config validation.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from miles.models.families.base import ModelFamily

# Modules of the package that are infrastructure, not families.
_NOT_FAMILIES = frozenset({"base", "build", "config", "registry", "rules", "tokenizer"})


class UnknownFamilyError(ValueError):
    """A family name that no module defines (a ValueError, so pydantic reports it as a config error)."""


@cache
def _families() -> dict[str, ModelFamily]:
    import miles.models.families as package

    found: dict[str, ModelFamily] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name in _NOT_FAMILIES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, ModelFamily):
            continue
        if family.name in found:
            raise RuntimeError(f"two modules define the family {family.name!r}")
        found[family.name] = family
    return found


def family_names() -> list[str]:
    """Names of every registered family, sorted."""
    return sorted(_families())


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; :class:`UnknownFamilyError` names the known ones otherwise."""
    families = _families()
    if name not in families:
        raise UnknownFamilyError(f"unknown model family {name!r} (known: {', '.join(sorted(families))})")
    return families[name]


def family_of(model_cfg: object) -> str | None:
    """The family name of a ``model:`` section of ``type: family``; None for any other model type (the
    generic rules then apply, e.g. to which tensors rollout quantization touches)."""
    return getattr(model_cfg, "family", None) if getattr(model_cfg, "type", None) == "family" else None
