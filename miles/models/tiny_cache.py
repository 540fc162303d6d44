"""Where the tiny model of a recipe is cached, and building it there exactly once.

Torch-free on purpose: every process that only *locates* the prepared model (the controller, ``miles run``
on a cache hit) imports this and never torch or transformers, which cost a process about 5 CPU seconds
(a Llama class alone pulls in torch's dynamo and DTensor modules). The builder is :mod:`miles.models.tiny`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog

from miles.config import TinyModelConfig

log = structlog.get_logger(__name__)

# Bump when the builder changes in a way that changes the built model, to invalidate caches.
BUILD_FORMAT = 2
BUILD_INFO_FILE = "miles_build.json"


def default_cache_dir() -> Path:
    """``~/.cache/miles/models`` (respects ``XDG_CACHE_HOME``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "miles" / "models"


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


def is_built(model_dir: Path) -> bool:
    return (model_dir / BUILD_INFO_FILE).is_file()


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Advisory inter-process lock so that concurrent callers build once (atomic rename keeps it safe anyway)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_tiny_model(final: Path, build: Callable[[Path], Any]) -> Path:
    """``final`` once a complete tiny-model build is there, calling ``build(tmp_dir)`` on a cache miss.

    The build goes to a private temporary directory that is renamed into place, so a reader never sees a
    half-written model even if the builder crashes; an inter-process lock makes concurrent callers build once.
    """
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    if is_built(final):
        return final
    with _build_lock(root / f".{final.name}.lock"):
        if is_built(final):  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.", dir=root))
        try:
            log.info("building tiny model", dir=str(final))
            build(tmp)
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if not is_built(final):
                    raise RuntimeError(f"{final} exists but is not a complete tiny-model build; delete it") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("tiny model ready", dir=str(final))
    return final
