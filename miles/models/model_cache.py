"""The machine's cache of models built offline (the tiny Llama, the families' tiny twins): where it is, and
building an entry there exactly once. Torch-free: processes that only locate a built model import it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

BUILD_INFO_FILE = "miles_build.json"  # written last by a builder: its presence marks a complete build


def default_cache_dir() -> Path:
    """``~/.cache/miles/models`` (respects ``XDG_CACHE_HOME``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "miles" / "models"


def is_built(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a complete build (its build info is written last)."""
    return (model_dir / BUILD_INFO_FILE).is_file()


def build_once(final: Path, build: Callable[[Path], T], what: str) -> T | None:
    """Build ``final`` with ``build(tmp_dir)`` unless a complete build is already there; returns what ``build``
    returned, or None when nothing was built.

    The build goes to a private temporary directory that is renamed into place, so a reader never sees a
    half-written model even if the builder crashes; an inter-process lock makes concurrent callers build once.
    ``what`` names the entry in the error for a directory in the way that is not a complete build.
    """
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    if is_built(final):
        return None
    with _build_lock(root / f".{final.name}.lock"):
        if is_built(final):  # another process built it while we waited
            return None
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.", dir=root))
        try:
            result = build(tmp)
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if not is_built(final):
                    raise RuntimeError(f"{final} exists but is not a complete {what} build; delete it") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return result


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Advisory inter-process lock so that concurrent callers build once (the atomic rename keeps it safe anyway)."""
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
