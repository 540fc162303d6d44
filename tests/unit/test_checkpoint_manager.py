"""CheckpointManager in one process: interval, completion marker, keep-latest-k, async finishing, errors."""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

import pytest

from miles.training.checkpoint import EXTRA, MARKER, CheckpointManager


class FakeBackend:
    """Writes one shard file; an asynchronous save hands back a future the test resolves."""

    def __init__(self) -> None:
        self.futures: list[Future] = []
        self.saved: list[str] = []
        self.loaded: list[str] = []

    def save_checkpoint(self, path: str, *, asynchronous: bool = False) -> Future | None:
        Path(path).mkdir(parents=True)
        (Path(path) / "__0_0.distcp").write_bytes(b"shard")
        self.saved.append(path)
        if not asynchronous:
            return None
        fut: Future = Future()
        self.futures.append(fut)
        return fut

    def load_checkpoint(self, path: str) -> None:
        self.loaded.append(path)


def test_due_every_n_steps() -> None:
    manager = CheckpointManager("unused", every=5, keep=2)
    assert [s for s in range(0, 21) if manager.due(s)] == [5, 10, 15, 20]
    assert not any(CheckpointManager("unused", every=0, keep=1).due(s) for s in range(10))
    with pytest.raises(ValueError):
        CheckpointManager("unused", every=1, keep=0)


def test_sync_save_is_complete_with_extra(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", every=1, keep=3)
    assert manager.latest() is None
    manager.save(10, FakeBackend(), {"policy_version": 10, "positions": {"traj": 42}})
    path, extra = manager.latest()  # type: ignore[misc]
    assert path == tmp_path / "checkpoints" / "step-00000010"
    assert extra == {"policy_version": 10, "positions": {"traj": 42}}
    marker = json.loads((path / MARKER).read_text())
    assert marker["step"] == 10 and marker["world_size"] == 1 and marker["format"] == 1
    assert not [p for p in path.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_keeps_latest_k_and_drops_stale_partials(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every=1, keep=2)
    backend = FakeBackend()
    (tmp_path / "step-00000002").mkdir(parents=True)  # an interrupted save from before a restart
    for step in (1, 3, 4, 5):
        manager.save(step, backend, {"step": step})
    assert manager.steps() == [4, 5]
    assert manager.steps(complete=False) == [4, 5]


def test_incomplete_checkpoint_is_never_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every=1, keep=5)
    manager.save(3, FakeBackend(), {"v": 3})
    partial = manager.path(7)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    (partial / EXTRA).write_text("{}")
    path, extra = manager.latest()  # type: ignore[misc]
    assert path.name == "step-00000003" and extra == {"v": 3}
    backend = FakeBackend()
    assert manager.load_latest(backend) == (3, {"v": 3})
    assert backend.loaded == [str(manager.path(3))]


def test_saving_a_step_again_replaces_the_old_attempt(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every=1, keep=5)
    stale = manager.path(4)
    stale.mkdir()
    (stale / "garbage").write_text("x")
    manager.save(4, FakeBackend(), {"v": 4})
    assert not (stale / "garbage").exists() and (stale / MARKER).exists()


def test_async_save_completes_on_poll_and_wait(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every=1, keep=5, asynchronous=True)
    backend = FakeBackend()
    manager.save(1, backend, {"v": 1})
    assert manager.latest() is None and manager.poll() is None  # still writing: not a checkpoint yet
    backend.futures[0].set_result(None)
    assert manager.poll() == 1
    assert manager.latest()[1] == {"v": 1}  # type: ignore[index]

    manager.save(2, backend, {"v": 2})
    assert manager.steps() == [1]
    backend.futures[1].set_result(None)
    manager.save(3, backend, {"v": 3})  # waits for step 2 first
    assert manager.steps() == [1, 2]
    backend.futures[2].set_result(None)
    manager.close()
    assert manager.steps() == [1, 2, 3]


def test_async_write_error_surfaces_and_leaves_no_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every=1, keep=5, asynchronous=True)
    backend = FakeBackend()
    manager.save(1, backend, {"v": 1})
    backend.futures[0].set_exception(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        manager.poll()
    with pytest.raises(RuntimeError, match="rank 0: OSError: disk full"):
        manager.save(2, backend, {"v": 2})
    assert manager.latest() is None

    manager.save(3, backend, {"v": 3})
    backend.futures[-1].set_exception(OSError("gone"))
    with pytest.raises(RuntimeError, match="gone"):
        manager.close()


def test_context_manager_finishes_on_exit(tmp_path: Path) -> None:
    backend = FakeBackend()
    with CheckpointManager(tmp_path, every=1, keep=5, asynchronous=True) as manager:
        manager.save(1, backend, {})
        backend.futures[0].set_result(None)
    assert manager.steps() == [1]


def test_extra_must_be_json(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every=1, keep=5)
    backend = FakeBackend()
    with pytest.raises(TypeError):
        manager.save(1, backend, {"bad": object()})
    assert backend.saved == []
