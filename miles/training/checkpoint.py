"""The trainer's checkpoint manager: when to save, where, what counts as complete, how many to keep.

One component owns the whole policy (interval, keep-latest-k, asynchronous saves, the completion marker),
so neither the trainer actor nor the backend carries save logic of its own. The backend only writes and
reads its shards (:meth:`~miles.backends.base.TrainBackend.save_checkpoint` / ``load_checkpoint``, e.g.
:mod:`miles.backends.fsdp_checkpoint`); the manager decides everything else.

Layout under ``root``::

    step-00000010/            one checkpoint per saved step (the step is the policy version)
        __0_0.distcp ...      the backend's shards (every rank writes its own)
        .metadata             DCP's metadata (written by rank 0 after every shard)
        extra.json            the trainer's state (policy version, stream positions, ...), opaque here
        COMPLETE              the commit marker: {"step", "world_size", "format", "saved_at", "seconds"}

Crash semantics (what a restart sees, whatever instant the crash hit):

* A checkpoint is **complete if and only if** its ``COMPLETE`` file exists. Rank 0 writes it last, after
  every shard and the metadata are durable (the backend's save returned, or its asynchronous handle
  resolved, on rank 0: DCP's coordinator finishes only once every rank's write succeeded) and after
  ``extra.json``. Both files are written to a temporary name, fsynced, renamed into place and the
  directory fsynced, so a marker is never seen half written and never survives a power loss without the
  data it vouches for.
* :meth:`CheckpointManager.latest` only returns complete checkpoints, so a crash in the middle of a save
  leaves the previous checkpoint as the newest one; the partial directory is ignored, deleted once a newer
  checkpoint completes, or replaced if the same step is saved again.
* Pruning deletes the marker first (fsynced) and the data after it, so a crash in the middle of a
  deletion leaves an incomplete directory, never a "complete" one with missing shards.
* Asynchronous saves: a checkpoint becomes complete only when it is *finished* (:meth:`poll` on rank 0, or
  :meth:`wait`, which the next :meth:`save` and :meth:`close` call). Anything the caller does only after a
  durable checkpoint (acking the trajectories a step trained on) must wait for that: a crash before it
  redelivers them, and the restart resumes from the previous checkpoint, consistently.
* Errors surface: a failed write raises from :meth:`wait` (hence from the next :meth:`save` or
  :meth:`close`) on every rank; a failure of rank 0's own part (the marker) is broadcast, so no rank
  carries on believing in a checkpoint that does not exist.

All ranks construct the manager with the same arguments; :meth:`save`, :meth:`wait` and :meth:`close` are
collective. The ``root`` must be one directory every rank sees (a shared filesystem across nodes): rank 0
writes the markers and prunes, and a checkpoint is read back on another rank count.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import structlog
import torch.distributed as dist

from miles.failpoints import failpoint

log = structlog.get_logger(__name__)

MARKER = "COMPLETE"
EXTRA = "extra.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class PendingWrite(Protocol):
    """What an asynchronous backend save returns (e.g. :class:`miles.backends.fsdp_checkpoint.SaveHandle`)."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> None: ...


class CheckpointBackend(Protocol):
    """The part of :class:`~miles.backends.base.TrainBackend` the manager uses. ``save_checkpoint`` is
    called with ``asynchronous=True`` only by a manager built with ``asynchronous=True``; a backend that
    cannot save asynchronously returns ``None`` (saved synchronously)."""

    def save_checkpoint(self, path: str, *, asynchronous: bool = False) -> PendingWrite | None: ...

    def load_checkpoint(self, path: str) -> Any: ...


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a broadcast, hence a barrier too). Collective."""
    if _world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order. Collective."""
    if _world_size() == 1:
        return [obj]
    out: list[Any] = [None] * _world_size()
    dist.all_gather_object(out, obj)
    return out


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """tmp + fsync + rename + directory fsync: ``path`` holds either nothing or all of ``data``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _remove(directory: Path) -> None:
    """Un-complete first (marker gone, durably), then delete the data."""
    marker = directory / MARKER
    if marker.exists():
        marker.unlink()
        _fsync_dir(directory)
    shutil.rmtree(directory)


@dataclass(slots=True)
class _Pending:
    step: int
    path: Path
    write: PendingWrite | None  # None: written synchronously, only the marker is left
    extra: dict[str, Any]
    started: float
    finished: bool = False


class CheckpointManager:
    """Saves every ``every`` steps into ``root/step-<step>``, keeps the newest ``keep`` complete ones.

    ``every == 0`` disables periodic saves (:meth:`due` is always False; :meth:`save` still works, e.g.
    for a final checkpoint). ``asynchronous`` asks the backend for asynchronous saves (module docstring).
    """

    def __init__(self, root: str | os.PathLike[str], every: int, keep: int, asynchronous: bool = False) -> None:
        if every < 0:
            raise ValueError("every must be >= 0")
        if keep < 1:
            raise ValueError("keep must be >= 1 (the newest complete checkpoint is what a restart needs)")
        self.root = Path(root)
        self.every = every
        self.keep = keep
        self.asynchronous = asynchronous
        self.rank = _rank()
        self._pending: _Pending | None = None

    # ------------------------------------------------------------------ queries (local, no collectives)

    def due(self, step: int) -> bool:
        """Whether the manager saves after ``step`` (a positive multiple of ``every``)."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def path(self, step: int) -> Path:
        if step < 0:
            raise ValueError("step must be >= 0")
        return self.root / f"step-{step:08d}"

    def steps(self, *, complete: bool = True) -> list[int]:
        """Steps with a checkpoint directory, ascending (only complete ones by default)."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir() and (not complete or (entry / MARKER).is_file()):
                found.append(int(match[1]))
        return sorted(found)

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest complete checkpoint and its ``extra``, or None. Incomplete ones are never returned."""
        steps = self.steps()
        if not steps:
            return None
        path = self.path(steps[-1])
        marker = json.loads((path / MARKER).read_text())
        if marker.get("format") != FORMAT or marker.get("step") != steps[-1]:
            raise ValueError(f"{path / MARKER}: not a Miles checkpoint marker of step {steps[-1]}: {marker}")
        return path, json.loads((path / EXTRA).read_text())

    def oldest_extra(self) -> tuple[int, dict[str, Any]] | None:
        """The oldest complete checkpoint kept (the furthest back a restart can go) and its ``extra``, or None."""
        steps = self.steps()
        if not steps:
            return None
        return steps[0], json.loads((self.path(steps[0]) / EXTRA).read_text())

    # ------------------------------------------------------------------ saving (collective)

    def save(self, step: int, backend: CheckpointBackend, extra: dict[str, Any]) -> None:
        """Checkpoint ``backend`` as ``step`` with the trainer's ``extra`` (JSON; rank 0's is the one kept).

        Collective. Finishes the previous asynchronous save first (raising its error, if any). Synchronous:
        returns once the checkpoint is complete on disk. Asynchronous: returns once the backend has staged
        its state; the checkpoint completes at :meth:`poll` / :meth:`wait`.
        """
        self.wait()
        path = self.path(step)
        payload = b""
        error: tuple[str, str] | None = None  # (kind, message), decided on rank 0
        if self.rank == 0:
            try:
                payload = json.dumps(extra, sort_keys=True).encode()
            except (TypeError, ValueError) as exc:
                error = ("extra", f"checkpoint extra is not JSON: {exc}")
            if error is None:
                try:
                    self.root.mkdir(parents=True, exist_ok=True)
                    if path.exists():  # an interrupted (or superseded) attempt at the same step
                        log.warning("checkpoint.replacing", step=step, path=str(path))
                        _remove(path)
                except OSError as exc:
                    error = ("os", f"preparing {path} failed on rank 0: {type(exc).__name__}: {exc}")
        error = _from_rank0(error)  # every rank raises the same; no rank writes before rank 0 cleared the directory
        if error is not None:
            raise (TypeError if error[0] == "extra" else RuntimeError)(f"checkpoint step {step}: {error[1]}")
        started = time.perf_counter()
        if self.asynchronous:
            write = backend.save_checkpoint(str(path), asynchronous=True)
        else:
            write = backend.save_checkpoint(str(path))
        self._pending = _Pending(step, path, write, json.loads(payload) if payload else {}, started)
        if write is None:
            self.wait()

    def poll(self) -> int | None:
        """Finish the pending asynchronous save if its write is done, without waiting: rank 0 writes the marker.
        Returns the step that became complete (rank 0) or whose write finished (other ranks), else None.
        Local: no collective, so rank 0 may call it from its loop. Raises the write's error if it failed."""
        pending = self._pending
        if pending is None or pending.finished or (pending.write is not None and not pending.write.done()):
            return None
        self._finish(pending)
        return pending.step

    def wait(self) -> None:
        """Wait for the pending save (if any) to be complete on every rank; raise its error. Collective."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        error: str | None = None
        try:
            if not pending.finished:
                self._finish(pending)
        except Exception as exc:  # every rank learns of it below (no rank may skip the collective), then raises
            error = f"{type(exc).__name__}: {exc}"
        failed = [(rank, err) for rank, err in enumerate(_gather(error)) if err is not None]
        if failed:
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise RuntimeError(f"checkpoint step {pending.step} failed: {detail}")

    def close(self) -> None:
        """Finish the pending save (at shutdown: an unfinished asynchronous save is not a checkpoint)."""
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        elif self._pending is not None and self._pending.write is not None:
            # Already failing: do not start a collective, but never leave DCP's writer thread unobserved.
            try:
                self._pending.write.result()
            except Exception as write_exc:
                log.error("checkpoint.write_failed", step=self._pending.step, error=repr(write_exc))
            self._pending = None

    def _finish(self, pending: _Pending) -> None:
        """This rank's end of a save: its write is done; on rank 0 the marker goes down and old ones go."""
        if pending.write is not None:
            pending.write.result()
        pending.finished = True
        if self.rank != 0:
            return
        failpoint("checkpoint")  # the shards are written, the checkpoint is not complete yet
        _write_atomic(pending.path / EXTRA, json.dumps(pending.extra, sort_keys=True).encode())
        seconds = round(time.perf_counter() - pending.started, 3)
        marker = {
            "step": pending.step,
            "world_size": _world_size(),
            "format": FORMAT,
            "saved_at": time.time(),
            "seconds": seconds,
        }
        _write_atomic(pending.path / MARKER, json.dumps(marker).encode())
        log.info("checkpoint.complete", step=pending.step, path=str(pending.path), seconds=seconds)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; drop incomplete ones older than the newest complete."""
        complete = self.steps()
        if not complete:
            return
        doomed = complete[: -self.keep]
        doomed += [s for s in self.steps(complete=False) if s < complete[-1] and s not in complete]
        for step in sorted(doomed):
            _remove(self.path(step))
        if doomed:
            log.info("checkpoint.pruned", steps=sorted(doomed), kept=complete[-self.keep :])

    # ------------------------------------------------------------------ loading (collective)

    def load_latest(self, backend: CheckpointBackend) -> tuple[int, dict[str, Any]] | None:
        """Restore the newest complete checkpoint into ``backend``: ``(step, extra)``, or None if there is
        none. Collective; every rank reads rank 0's choice, so ranks never load different steps."""
        choice: tuple[str, dict[str, Any]] | None = None
        error: str | None = None
        if self.rank == 0:
            try:
                found = self.latest()
                choice = None if found is None else (str(found[0]), found[1])
            except (OSError, ValueError) as exc:  # raised on every rank below
                error = f"{type(exc).__name__}: {exc}"
        choice, error = _from_rank0((choice, error))
        if error is not None:
            raise RuntimeError(f"cannot choose a checkpoint under {self.root}: {error}")
        if choice is None:
            return None
        path, extra = Path(choice[0]), choice[1]
        backend.load_checkpoint(str(path))
        step = int(_STEP_DIR.match(path.name)[1])  # type: ignore[index]
        log.info("checkpoint.restored", step=step, path=str(path))
        return step, extra
