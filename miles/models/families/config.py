"""The ``model:`` section for a model family (``type: family``): torch-free, strict, validated against the registry.

``miles/config.py`` adds :class:`FamilyModelConfig` to its ``ModelConfig`` union. It lives here, not there,
so that a family's knobs stay next to the family code (on the shared base of :mod:`miles.config_base`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles.config_base import Strict as _Strict


class TinyDims(_Strict):
    """Size knobs of a tiny twin; every other dimension of the family's tiny config follows from these."""

    hidden_size: int = Field(
        64, ge=32, le=512, multiple_of=32, description="Width of the residual stream (4 attention heads)."
    )
    num_layers: int = Field(
        2, ge=2, le=8, description="Decoder layers; the family's layer pattern (dense/MoE, sliding/full) repeats."
    )
    num_experts: int = Field(4, ge=2, le=16, description="Routed experts per MoE layer.")
    experts_per_token: int = Field(2, ge=1, le=16, description="Routed experts each token is sent to (top-k).")

    @model_validator(mode="after")
    def _check(self) -> TinyDims:
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) must not exceed num_experts ({self.num_experts})"
            )
        return self


class FamilyModelConfig(_Strict):
    """A model of one of the supported families (docs/models.md): its full-size checkpoint, or its tiny twin.

    The tiny twin is the family's transformers architecture class with a tiny config and a tiny BPE
    tokenizer carrying the family's chat template, built offline and cached by a hash of everything that
    determines it. The full size is a checkpoint directory on disk (never downloaded); its ``config.json``
    must be of the family's model type.
    """

    type: Literal["family"] = "family"
    family: str = Field(description="Family name: deepseek_v32, kimi_k26, qwen38, glm52, gemma4 or gpt_oss.")
    size: Literal["tiny", "full"] = Field("tiny", description="'tiny': build the offline twin; 'full': load path.")
    variant: str | None = Field(
        None, description="Full-size variant (e.g. gpt_oss '120b' or '20b'); None: the family's default."
    )
    path: str | None = Field(None, description="size 'full': checkpoint directory (config.json, weights, tokenizer).")
    tiny: TinyDims = Field(default_factory=TinyDims, description="size 'tiny': dimensions of the twin.")
    seed: int = Field(0, description="size 'tiny': seed of the random init.")
    cache_dir: str | None = Field(
        None, description="size 'tiny': where twins are cached (default ~/.cache/miles/models), keyed by hash."
    )

    @model_validator(mode="after")
    def _check(self) -> FamilyModelConfig:
        from miles.models.families.registry import get_family

        family = get_family(self.family)  # UnknownFamilyError (a ValueError) naming the known families
        if self.variant is not None and self.variant not in family.variants:
            raise ValueError(
                f"model.variant {self.variant!r} is not a {self.family} variant (one of {', '.join(family.variants)})"
            )
        if self.size == "full" and not self.path:
            raise ValueError("model.size 'full' needs model.path (a checkpoint directory; nothing is downloaded)")
        if self.size == "tiny" and self.path is not None:
            raise ValueError("model.path is only read for model.size 'full' (the tiny twin is built offline)")
        return self
