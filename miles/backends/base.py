"""The training-backend interface: log-probs, one optimizer step, weight export, checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class TrainSample:
    """One trajectory as the trainer consumes it."""

    prompt_ids: list[int]
    output_ids: list[int]
    behaviour_logprobs: list[float]  # one per output token, from the engine
    advantage: float
    weight_version: int


@dataclass(slots=True)
class StepResult:
    """What one optimizer step reports (already reduced across ranks)."""

    metrics: dict[str, float] = field(default_factory=dict)


class TrainBackend(Protocol):
    """Data-parallel policy training. Every rank calls every method collectively."""

    def train_step(self, samples: list[TrainSample]) -> StepResult:
        """One optimizer step over this rank's shard of the batch."""
        ...

    def export_weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights in rollout precision on rank 0; empty dict on other ranks."""
        ...

    def save_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        """Write model, optimizer and ``extra`` (policy version, bus position) durably to ``path``."""
        ...

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore model and optimizer from ``path``; return the ``extra`` saved with them."""
        ...
