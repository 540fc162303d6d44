"""From a published weight set (rollout precision) to what an engine loads.

The trainer publishes weights in rollout precision (``sync.dtype``), or only the LoRA adapter
(``sync.mode: lora``). Rollout workers and the trainer's evaluator turn such a state into engine
weights the same way, here, so the evaluated policy is exactly the one the workers run:

* plain precisions (bf16, fp32): the state itself, a complete model state; after a delta, only the
  changed elements (:meth:`EngineWeights.decode_changes`), so the generation pause is proportional to
  the change, not to the model;
* FP8 / FP4: dequantized (:func:`miles.sync.precision.from_rollout_state`), a complete model state;
* LoRA: the adapted modules' merged weights on the frozen base (:class:`miles.sync.lora.AdapterApplier`),
  a *partial* update: every other tensor is the base the engine already holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch

from miles.engines.base import SparseValues
from miles.sync.lora import AdapterApplier
from miles.sync.precision import from_rollout_state, is_quantized


class EngineWeights:
    """Decodes published states for one engine. ``engine_state`` returns the engine's state dict (read
    once per adapted module, before any adapter is applied to it); ``lora_scale`` is set in LoRA mode
    for an engine that takes merged weights. ``adapters="passthrough"`` hands LoRA adapters through
    untouched, for an engine that applies adapters itself (SGLang)."""

    def __init__(
        self,
        engine_state: Callable[[], Mapping[str, torch.Tensor]],
        *,
        precision: str = "bfloat16",
        lora_scale: float | None = None,
        adapters: Literal["merge", "passthrough"] = "merge",
    ) -> None:
        self.precision = precision
        self.passthrough = adapters == "passthrough"
        self.adapters = None if lora_scale is None or self.passthrough else AdapterApplier(engine_state, lora_scale)

    def decode(self, published: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
        """``(tensors to load, complete)``; ``complete`` is False for a LoRA update (adapted modules only).
        Raises ``ValueError`` naming the tensor if the state does not fit."""
        if self.passthrough:
            return dict(published), False
        if self.adapters is not None:
            return self.adapters.merged(published), False
        if is_quantized(self.precision):
            return from_rollout_state(dict(published), torch.float32), True
        return dict(published), True

    def decode_changes(
        self, published: Mapping[str, torch.Tensor], changes: Mapping[str, torch.Tensor]
    ) -> dict[str, SparseValues] | None:
        """A sparse update for a state that differs from the previous one only at ``changes`` (flat positions
        per tensor, from the delta decoder), or None where that cannot be expressed so (quantized codes
        dequantize through their scales; an adapter replaces whole modules): stage the full decode then."""
        if self.adapters is not None or self.passthrough or is_quantized(self.precision):
            return None
        return {
            name: SparseValues(index, published[name].reshape(-1)[index])
            for name, index in changes.items()
            if index.numel()
        }
