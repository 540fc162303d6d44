"""Model families (docs/models.md): per-family facts as data, tiny offline twins, and the rules built on them.

Torch-free at import: ``get_family`` and the config class are usable without loading torch; the twin
builder (:mod:`miles.models.families.build`) and the quantization rule import it when called.
"""

from miles.models.families.base import ModelFamily
from miles.models.families.config import FamilyModelConfig, TinyDims
from miles.models.families.registry import UnknownFamilyError, family_names, get_family

__all__ = ["FamilyModelConfig", "ModelFamily", "TinyDims", "UnknownFamilyError", "family_names", "get_family"]
