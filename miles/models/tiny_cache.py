"""Where the tiny model of a recipe is cached, and building it there exactly once.

Torch-free on purpose: every process that only *locates* the prepared model (the controller, ``miles run``
on a cache hit) imports this and never torch or transformers, which cost a process about 5 CPU seconds
(a Llama class alone pulls in torch's dynamo and DTensor modules). The builder is :mod:`miles.models.tiny`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from miles.config import TinyModelConfig
from miles.models.model_cache import build_once, default_cache_dir

log = structlog.get_logger(__name__)

# Bump when the builder changes in a way that changes the built model, to invalidate caches.
BUILD_FORMAT = 2


def cache_key(model_cfg: TinyModelConfig, task_fingerprint: dict[str, Any]) -> str:
    """Stable short hash of everything that determines the built model (not where it is cached)."""
    payload = {
        "format": BUILD_FORMAT,
        "model": model_cfg.model_dump(mode="json", exclude={"cache_dir"}),
        "task": task_fingerprint,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def tiny_model_dir(model_cfg: TinyModelConfig, task_fingerprint: dict[str, Any]) -> Path:
    """Where the tiny model of (``model_cfg``, task) is (or would be) cached."""
    root = Path(model_cfg.cache_dir).expanduser() if model_cfg.cache_dir else default_cache_dir()
    return root / f"tiny-{cache_key(model_cfg, task_fingerprint)}"


def ensure_tiny_model(final: Path, build: Callable[[Path], Any]) -> Path:
    """``final`` once a complete tiny-model build is there, calling ``build(tmp_dir)`` on a cache miss
    (:func:`~miles.models.model_cache.build_once`: built once, renamed into place whole)."""

    def logged(tmp: Path) -> Any:
        log.info("building tiny model", dir=str(final))
        return build(tmp)

    build_once(final, logged, "tiny-model")
    log.info("tiny model ready", dir=str(final))
    return final
