"""The base of every config section: strict pydantic models, and variants chosen by ``type``.

Its own module, so that the config sections that live next to their code (the sandbox, terminal tasks, model
families) and the config tree that assembles them (:mod:`miles.config`) import the same base without a cycle.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Discriminator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def variant(default: str) -> Discriminator:
    """Discriminate on ``type``; a section that omits ``type`` gets the default variant."""

    def tag(value: Any) -> str:
        if isinstance(value, dict):
            return str(value.get("type", default))
        return str(getattr(value, "type", default))

    return Discriminator(tag)
