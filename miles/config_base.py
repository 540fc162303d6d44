"""The base of every config section: strict pydantic models, and variants chosen by ``type``.

Its own module, so that the config sections that live next to their code (the sandbox, terminal tasks, model
families) and the config tree that assembles them (:mod:`miles.config`) import the same base without a cycle.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, field_validator

RewardRange = tuple[float, float]
REWARD_RANGE_DOC = (
    "[low, high] of every reward the task can give (an evaluation's accuracy is their mean). A reward outside it "
    "fails its episode on the worker (reward_failed), and the trainer and the controller refuse trajectories and "
    "evaluation shards outside it, from a dishonest worker too (docs/security.md). null: any finite number."
)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TaskBase(Strict):
    """What every task variant declares besides its own fields."""

    reward_range: RewardRange | None = Field((0.0, 1.0), description=REWARD_RANGE_DOC)

    @field_validator("reward_range")
    @classmethod
    def _ordered(cls, value: RewardRange | None) -> RewardRange | None:
        if value is not None and not (math.isfinite(value[0]) and math.isfinite(value[1]) and value[0] <= value[1]):
            raise ValueError(f"{list(value)} is not [low, high] with finite low <= high")
        return value


# The name of a weight transport or a sync mode (sync.transport, sync.mode, announcements, run info): registered
# by name (a transport on both sides), so no list of names is closed in the config or the schema.
REGISTERED_NAME = r"^[a-z][a-z0-9_]{0,31}$"

# The tag of a variant named by a user's import path (``type: package.module:Name``, miles.plugins).
IMPORT_TAG = "import"


def variant(default: str) -> Discriminator:
    """Discriminate on ``type``; a section that omits ``type`` gets the default variant, one whose ``type`` is
    an import path the ``import`` variant (where the section takes one)."""

    def tag(value: Any) -> str:
        kind = str(value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default))
        return IMPORT_TAG if ":" in kind else kind

    return Discriminator(tag)
