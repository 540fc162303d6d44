"""Durable checkpoint writes: complete file or the previous one, never a torn one."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from miles.backends.checkpoint_io import atomic_torch_save, load_torch


def test_roundtrip_and_no_leftovers(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ckpt.pt"
    atomic_torch_save({"w": torch.arange(3), "extra": {"version": 4, "name": "x"}}, path)
    loaded = load_torch(path)
    assert torch.equal(loaded["w"], torch.arange(3)) and loaded["extra"] == {"version": 4, "name": "x"}
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]


def test_failed_write_keeps_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    atomic_torch_save({"version": 1}, path)
    with pytest.raises(Exception):
        atomic_torch_save({"bad": threading.Lock()}, path)  # not picklable: fails mid-write
    assert load_torch(path) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_load_refuses_pickled_code(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"f": Path("x")}, path)
    with pytest.raises(Exception):
        load_torch(path)
