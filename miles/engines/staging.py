"""What an engine over an inference server stages: the rules for a state it accepts, and the newest-wins slot
its background loader takes versions from. The SGLang and vLLM engines share both; each loads in its own way
(SGLang from a checkpoint directory on a thread, vLLM from a file through Miles' worker extension).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from miles.engines.adapter_files import validate_adapter
from miles.engines.base import SparseValues

if TYPE_CHECKING:
    import torch

    from miles.config import LoraConfig


def whole_state(
    state: Mapping[str, torch.Tensor | SparseValues],
    *,
    server: str,
    lora: LoraConfig | None,
    base_version: int | None,
    complete: bool,
) -> dict[str, torch.Tensor] | None:
    """``state`` as whole tensors to stage, or None for the follower's delta fast path (sparse values against
    ``base_version``), which a server that loads whole tensors declines: the follower then stages the whole
    reconstructed state.

    Raises ``ValueError`` (nothing staged) for other sparse updates, an empty state, a partial state outside
    LoRA mode, and in LoRA mode a state that is not a peft adapter of ``lora``'s rank and target modules."""
    sparse = [name for name, value in state.items() if isinstance(value, SparseValues)]
    if base_version is not None and (sparse or not complete) and lora is None:
        return None
    if sparse:
        raise ValueError(
            f"stage_weights: {server} loads whole tensors; {len(sparse)} sparse update(s) (e.g. {sparse[0]!r}): "
            "reconstruct the full state first"
        )
    if not state:
        raise ValueError("stage_weights: empty state")
    tensors: dict[str, torch.Tensor] = dict(state)  # type: ignore[arg-type]  # no SparseValues left
    if lora is not None:
        validate_adapter(tensors, lora)
    elif not complete:
        raise ValueError(
            f"stage_weights: {server} reloads whole states; a partial update (complete=False) must be "
            "reconstructed into a complete state first"
        )
    return tensors


class StagedSlot:
    """The newest version staged and not yet taken by the loader, and the one it is loading.

    Thread-safe: the follower stages from the event loop, a loader may run on a thread. A newer stage replaces an
    older one not yet taken; nothing older than what the engine runs, loads or has staged is accepted."""

    def __init__(self) -> None:
        self.cond = threading.Condition()  # guards the fields below; never held across disk or HTTP
        self.staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self.loading: int | None = None

    def offer(self, version: int, tensors: dict[str, torch.Tensor], running: int) -> bool:
        """Stage ``tensors`` as ``version`` if newer than ``running`` (the engine's version) and the slot's."""
        with self.cond:
            if version <= max(running, self._newest()):
                return False
            self.staged = (version, tensors)
            self.cond.notify_all()
            return True

    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The staged version, now marked as loading (call :meth:`done` after), or None if none is staged."""
        with self.cond:
            staged, self.staged = self.staged, None
            if staged is not None:
                self.loading = staged[0]
            return staged

    def done(self) -> None:
        """The load :meth:`take` started ended (adopted or failed)."""
        with self.cond:
            self.loading = None
            self.cond.notify_all()

    def retry(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Put a version whose load failed back, unless a newer one was staged meanwhile."""
        with self.cond:
            if self.staged is None:
                self.staged = (version, tensors)

    @property
    def pending(self) -> int | None:
        """The version staged or being loaded, not yet adopted; None if none."""
        with self.cond:
            return self.staged[0] if self.staged is not None else self.loading

    def _newest(self) -> int:
        """The newest version staged or loading, -1 if none (``cond`` held)."""
        return max(-1 if self.staged is None else self.staged[0], -1 if self.loading is None else self.loading)

    def clear(self) -> None:
        """Drop what is staged (shutdown); a load under way goes on."""
        with self.cond:
            self.staged = None
            self.cond.notify_all()
