"""Process-group helpers (single process, gloo)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from miles.backends.distributed import backend_for_device, destroy_distributed, distributed
from miles.ports import free_port


def test_backend_for_device() -> None:
    assert backend_for_device("cpu") == "gloo"
    assert backend_for_device("cuda") == "nccl"
    assert backend_for_device("cuda:1") == "nccl"


def test_join_from_environment_and_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with distributed(timeout_s=30) as info:
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert (info.rank, info.world_size, info.backend, info.master_port) == (0, 1, "gloo", port)
    assert not dist.is_initialized()
    destroy_distributed()  # idempotent


def test_leaves_on_error_and_validates_rank() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with distributed(0, 1, "127.0.0.1", free_port(), timeout_s=30):
            raise RuntimeError("boom")
    assert not dist.is_initialized()
    with pytest.raises(ValueError):
        with distributed(1, 1, "127.0.0.1", free_port()):
            pass
