"""A task's identity for caches: its config, plus the content of the files and directories it reads.

The tiny model is warmed up on a task's demonstrations, so its cache key must change when the data does,
not only when the config does: every config field named ``*_path`` or ``*_dir`` that points at an existing
file or directory contributes the SHA-256 of its bytes (a directory: of every file, by relative path), and a
user's task or reward named by import path the SHA-256 of its module's source file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from miles.plugins import is_import_path, source_digest


def _content_digest(path: Path) -> str:
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        digest.update(str(file.relative_to(path) if file != path else file.name).encode())
        digest.update(b"\0")
        digest.update(file.read_bytes())
    return digest.hexdigest()


def task_fingerprint(task_cfg: Any) -> dict[str, Any]:
    """The task config as JSON, with ``<field>_sha256`` for every ``*_path`` / ``*_dir`` field that exists."""
    fp: dict[str, Any] = task_cfg.model_dump(mode="json")
    for key, value in list(fp.items()):
        if (key.endswith("_path") or key.endswith("_dir")) and isinstance(value, str):
            path = Path(value).expanduser()
            fp[f"{key}_sha256"] = _content_digest(path) if path.exists() else None
    # A user's task or reward module: editing it must not reuse a model warmed up on the old one.
    for key in ("type", "reward", "agent"):
        value = fp.get(key)
        if isinstance(value, str) and is_import_path(value):
            fp[f"{key}_source_sha256"] = source_digest(value)
    return fp
