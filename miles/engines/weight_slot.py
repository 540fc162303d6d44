"""Staged weight updates for an in-process engine: validation, the pending slot, the in-place copy.

Why a slot and not a direct copy: the caller (the weight follower, on the event-loop thread) must never
wait for the sampling loop, and the loop must never see half-copied weights. So staging only validates
and parks; the loop thread copies at a token boundary, when no forward is running.

Semantics (kept from the batched engine this replaces):

* **Newest wins, never backwards.** A version not newer than the one in use, being applied, or already
  staged is refused; a worker several versions behind jumps straight to the newest.
* A **complete** state replaces everything staged. A **partial** update (``complete=False``) names only
  some tensors and queues behind what is staged; its values may be :class:`SparseValues`. With
  ``base_version`` it is a delta, refused unless the engine will be exactly at that version when it applies.

:class:`WeightSlot` is a plain data structure: the engine guards it with its own lock.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from miles.engines.base import SparseValues

StagedState = Mapping[str, torch.Tensor | SparseValues]


def validate_state(
    targets: Mapping[str, torch.Tensor], state: StagedState, what: str, *, complete: bool = True
) -> None:
    """Raise ``ValueError`` (naming the key) unless ``state`` fits ``targets``, the model's state dict.

    ``complete``: every target must be given, except tensors that share storage with a given one (tied
    embeddings may be sent once). Sparse values need 1-D int64 indices inside the target.
    """
    for key in state:
        if key not in targets:
            raise ValueError(f"{what}: unexpected key {key!r} (not in the model's state dict)")
    if complete:
        provided_storages = {targets[k].untyped_storage().data_ptr() for k in state}
        for key, target in targets.items():
            if key not in state and target.untyped_storage().data_ptr() not in provided_storages:
                raise ValueError(f"{what}: missing key {key!r}")
    for key, value in state.items():
        target = targets[key]
        if isinstance(value, SparseValues):
            index, values = value.index, value.values
            if index.dim() != 1 or values.dim() != 1 or index.numel() != values.numel():
                raise ValueError(f"{what}: sparse update of {key!r} needs 1-D index and values of equal length")
            if index.dtype != torch.int64:
                raise ValueError(f"{what}: sparse update of {key!r} has index dtype {index.dtype}, not int64")
            if index.numel() and not (0 <= int(index.min()) and int(index.max()) < target.numel()):
                raise ValueError(f"{what}: sparse update of {key!r} indexes outside its {target.numel()} elements")
        elif tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"{what}: shape mismatch for {key!r}: got {tuple(value.shape)}, model has {tuple(target.shape)}"
            )


def copy_into(targets: Mapping[str, torch.Tensor], states: list[StagedState]) -> float:
    """Copy ``states`` into ``targets`` in order (dtype and device converted); return the seconds it took."""
    start = time.perf_counter()
    with torch.no_grad():
        for state in states:
            for key, value in state.items():
                target = targets[key]
                if isinstance(value, SparseValues):
                    target.view(-1).index_copy_(0, value.index.to(target.device), value.values.to(target))
                else:
                    target.copy_(value)
    return time.perf_counter() - start


@dataclass(slots=True)
class Taken:
    """What the applying thread took from the slot: the version it leads to and the states to copy, in order."""

    version: int
    states: list[StagedState]


class WeightSlot:
    """Pending updates (one complete state, then partial ones) and the version being applied, if any."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, StagedState]] = []
        self.applying: int | None = None

    def pending_version(self) -> int | None:
        """Version staged or being applied, not yet adopted; None if none."""
        if self._pending:
            return self._pending[-1][0]
        return self.applying

    def has_pending(self) -> bool:
        return bool(self._pending)

    def newest(self, current: int) -> int:
        """Version the engine will be at once everything staged is applied."""
        return max(
            current,
            self._pending[-1][0] if self._pending else -1,
            self.applying if self.applying is not None else -1,
        )

    def offer(
        self, state: StagedState, version: int, *, current: int, base_version: int | None, complete: bool
    ) -> bool:
        """Park a validated update; False if it is not newer (or, a delta, not on the version it will be at)."""
        newest = self.newest(current)
        if version <= newest:
            return False
        if complete:
            self._pending = [(version, state)]
        elif base_version is not None and int(base_version) != newest:
            return False
        else:
            self._pending.append((version, state))
        return True

    def take(self, current: int) -> Taken | None:
        """Everything staged, marked as being applied; None if nothing newer than ``current`` is staged."""
        staged, self._pending = self._pending, []
        if not staged or staged[-1][0] <= current:
            return None
        self.applying = staged[-1][0]
        return Taken(staged[-1][0], [state for _, state in staged])

    def drop_superseded(self, version: int) -> None:
        """Forget staged updates not newer than ``version`` (``load_weights`` jumped past them)."""
        if self._pending and self._pending[-1][0] <= version:
            self._pending = []
