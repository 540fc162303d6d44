"""Config fields the new engines add, to be merged into ``miles/config.py`` (which this package does not own).

Merge: ``class TorchEngineConfig(TorchBatchingFields, Strict)`` and ``class SglangEngineConfig(SglangContextFields,
Strict)`` (or copy the ``Field`` lines into the classes). Until then the engines read the fields through
:func:`torch_batching` and :func:`sglang_max_context`, which fall back to the defaults below for a config that
lacks them, so they work against both the old and the merged config.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class TorchBatchingFields(BaseModel):
    """Continuous batching limits of the torch engine."""

    max_batch: int = Field(
        64, ge=1, description="Rows (requests) in the running batch; more wait in the queue until a row finishes."
    )
    max_prefill_tokens: int = Field(
        4096,
        ge=1,
        description="Padded prompt tokens (distinct prompts x longest) prefilled at one token boundary; bounds "
        "how long running rows wait while newcomers join (one request is always admitted).",
    )


class SglangContextFields(BaseModel):
    """What the SGLang client must know about the server's context window."""

    max_context: int | None = Field(
        None,
        ge=1,
        description="Most tokens (prompt + output) per request; None: the checkpoint's max_position_embeddings. "
        "Set it to the server's --context-length if that is smaller.",
    )


def torch_batching(cfg: Any) -> tuple[int, int]:
    """``(max_batch, max_prefill_tokens)`` of ``cfg``, or the defaults where the config has no such field."""
    defaults = TorchBatchingFields()
    return (
        int(getattr(cfg, "max_batch", defaults.max_batch)),
        int(getattr(cfg, "max_prefill_tokens", defaults.max_prefill_tokens)),
    )


def sglang_max_context(cfg: Any) -> int | None:
    """``cfg.max_context`` where the config has it, else None."""
    value = getattr(cfg, "max_context", None)
    return None if value is None else int(value)
