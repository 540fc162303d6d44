"""The generation-engine interface every rollout backend implements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class SamplingParams:
    """How to sample one completion. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Generation:
    """One sampled completion.

    ``logprobs[i]`` is the behaviour log-probability of ``output_ids[i]`` under the sampling
    distribution the engine actually drew from (temperature applied, before top-p truncation),
    which is what off-policy corrections need.

    ``weight_version`` is the version that sampled the first output token (the oldest one).
    ``version_spans`` is ``[(first output index, version), ...]`` in increasing index order: the
    version in force from that token on, one span when the weights did not change mid-generation
    (left empty by an engine, it becomes ``[(0, weight_version)]``).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    weight_version: int
    version_spans: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.version_spans:
            self.version_spans = [(0, self.weight_version)]


@dataclass(frozen=True, slots=True)
class SparseValues:
    """New values at some flat positions of one tensor: ``tensor.view(-1)[index] = values``.

    A delta-mode sync stages these instead of whole tensors, so the generation pause touches only the
    elements that changed (about 2% of BF16 weights per step) rather than copying every tensor.
    """

    index: torch.Tensor  # (k,) int64, flat positions into the target tensor
    values: torch.Tensor  # (k,) new values (cast to the target's dtype when applied)


class Engine(Protocol):
    """A policy that samples tokens at a known weight version."""

    @property
    def version(self) -> int:
        """Policy version of the weights currently used for generation."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one completion per prompt (batched). Blocking; actors call it in a worker thread."""
        ...

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Swap in a full set of weights (names as in the HF state dict) and adopt ``version``."""
        ...


class StagingEngine(Engine, Protocol):
    """An engine that takes new weights in the background and switches to them between tokens."""

    @property
    def pending_version(self) -> int | None:
        """Version staged (or being applied) but not yet in use; None if none."""
        ...

    switches: int
    last_pause_s: float

    def stage_weights(
        self,
        state: Mapping[str, torch.Tensor | SparseValues],
        version: int,
        *,
        base_version: int | None = None,
        complete: bool = True,
    ) -> bool:
        """Validate and park weights for the next token boundary; False if not newer than what it holds
        (or, for a partial update with ``base_version``, if the engine will not be at that version)."""
        ...

    def apply_pending(self) -> bool:
        """Apply staged weights now if idle; True if the version changed."""
        ...
