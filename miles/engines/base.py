"""The generation-engine interface every rollout backend implements.

Engines take requests **one by one, asynchronously**: :meth:`Engine.generate` is a coroutine for a
single prompt (token ids in, token ids out), and many of them are in flight at once. The torch engine
batches them continuously (requests join and leave its running batch at token boundaries); the SGLang
engine sends each as its own ``/generate`` call and lets the server batch. A long episode therefore
never holds back a short one, and a multi-turn episode simply sends its next turn as a new request.

Weights change in the background (:class:`StagingEngine`): staged updates switch in at the next token
boundary, and every :class:`Generation` says which policy version sampled which of its tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from miles.sync.engine_weights import EngineWeights

FinishReason = Literal["stop", "length", "context"]


class EngineError(RuntimeError):
    """The engine failed (its loop thread died, the server refused a request); the message says why."""


@dataclass(slots=True)
class SamplingParams:
    """How to sample one completion. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Generation:
    """One sampled completion of one request.

    ``output_ids`` are exactly the sampled token ids (a stop token that ended the request included);
    ``logprobs[i]`` is the behaviour log-probability of ``output_ids[i]`` under the distribution the engine
    actually drew it from (temperature applied, before top-p truncation), which off-policy corrections need.

    ``finish_reason``: ``stop`` (a stop token), ``length`` (``max_new_tokens`` reached) or ``context`` (the
    model's context window is full: prompt plus output reached the engine's ``max_context``).

    ``weight_version`` is the version that sampled the first output token (the oldest one).
    ``version_spans`` is ``[(first output index, version), ...]`` in increasing index order: the version in
    force from that token on, one span when the weights did not change mid-generation (left empty by an
    engine, it becomes ``[(0, weight_version)]``).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
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
    """A policy that samples tokens at a known weight version, one asynchronous request at a time.

    Lifecycle: ``await engine.start()`` before the first request, ``await engine.close()`` at the end
    (also usable as ``async with engine:``). A failure of the engine itself (its loop thread died, the
    server is gone) makes every pending and later :meth:`generate` raise :class:`EngineError`, and is kept
    in :attr:`error`, so the actor that owns the engine fails loudly instead of waiting forever.
    """

    @property
    def version(self) -> int:
        """Policy version of the weights currently used for generation (-1: none yet)."""
        ...

    @property
    def max_context(self) -> int:
        """Most tokens (prompt plus output) one request may hold."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped working, or None while it works."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample one completion of ``prompt_ids``. Cancelling the awaiting task aborts the request."""
        ...

    def pinned(self) -> AbstractAsyncContextManager[int]:
        """``async with engine.pinned() as version:`` no staged weights switch in until the block ends, so
        every request generated inside it runs at ``version`` (used for evaluations at one version)."""
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
        (or, for a partial update with ``base_version``, if the engine will not be at that version).
        Thread-safe and non-blocking. Staged weights are applied by the engine itself: at the next token
        boundary of a running batch, or at once when it is idle (unless :meth:`Engine.pinned`)."""
        ...

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int, *, complete: bool = True) -> None:
        """Copy weights in now and adopt ``version`` (blocking; waits for the running step). For tests and
        start-up, not for the event loop."""
        ...

    def weight_sink(self, precision: str, lora_scale: float | None) -> EngineWeights:
        """How a state published in ``precision`` (``sync.dtype``) becomes this engine's weights; in LoRA mode
        ``lora_scale`` is the adapter's scale and the state is the adapter only. Its owner (the weight
        receiver) decodes every fetched state through it before :meth:`stage_weights`."""
        ...
