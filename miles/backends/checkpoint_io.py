"""Durable single-file writes: a checkpoint either exists complete or not at all.

The trainer acks trajectories on the bus once a checkpoint covering them is written, so a crash
mid-write must never leave a truncated file under the final name: we write a temporary file in the
same directory, fsync it, atomically rename it over the target and fsync the directory so that the
rename itself survives a power loss.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to ``path`` durably (tmp + fsync + rename + directory fsync)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def load_torch(path: str | os.PathLike[str]) -> Any:
    """Load a file written by :func:`atomic_torch_save` (tensors and plain Python data only, no pickled code)."""
    return torch.load(Path(path), map_location="cpu", weights_only=True)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms without directory handles (Windows)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
