"""KV-cache surgery for continuous batching over a Hugging Face ``DynamicCache``.

The running batch keeps one cache whose rows are requests at different lengths. Layout invariant:
every row's tokens are **contiguous and right-aligned** in the cache's sequence dimension, with padding
columns (attention mask 0) on the left. Merging newcomers left-pads the shorter of the two caches,
dropping a row removes it, and columns that are padding in every remaining row are trimmed off the left.

Why this is exact, and for which architectures (checked by ``tests/unit/test_engine_architectures.py``):

* Positions are passed explicitly per row (``position_ids``), so RoPE sees each row's own positions.
* Masks: HF builds causal and sliding-window masks from *cache column indices* plus the 2-D padding
  mask. Because a row's tokens are contiguous, the distance between two of its columns equals the
  distance between their positions, so a sliding window (Gemma 3, GPT-OSS) cuts at the right token.
* We use ``DynamicCache()`` **without** a config: every layer is a full ``DynamicLayer`` that keeps all
  tokens (a config would give sliding layers a ``DynamicSlidingWindowLayer`` that keeps only the last
  window, whose offsets cannot be merged across rows of different lengths). The window is then applied
  by the mask alone; sliding layers cost full-length memory, which is the price of merging.
* Each layer stores 4-D tensors ``(B, heads, T, dim)``: Llama/Qwen3/MoE keys and values, GPT-OSS too
  (its attention sinks are per-head parameters, not cache entries), and DeepSeek-V3's MLA latents
  (``(B, 1, T, kv_lora_rank)`` and ``(B, 1, T, rope_dim)``). The surgery never looks at the head dims.

Architectures whose cache is anything else (linear-attention/recurrent states such as Qwen3-Next, the
indexer keys of DeepSeek-V3.2's sparse attention) cannot be merged this way: :func:`batching_plan`
says so, and the engine falls back to batching only requests with identical prompts, with no padding
(see :class:`miles.engines.torch_loop.SamplingLoop`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

# Layer classes a config-built cache may contain for the continuous path to be exact: both become a plain
# full DynamicLayer in our config-less cache (the mask applies the window).
_MERGEABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


@dataclass(frozen=True, slots=True)
class BatchingPlan:
    """How the engine batches this model: ``continuous`` (cache surgery) or not, and why."""

    continuous: bool
    reason: str


def batching_plan(model: Any) -> BatchingPlan:
    """Decide from the model's own cache layout (the cache its config would build) whether rows can merge."""
    config = getattr(model, "config", None)
    if config is None:
        return BatchingPlan(True, "no config: assumed full attention")
    try:
        layers = DynamicCache(config=config).layers
    except TypeError:  # transformers without config-built caches: every layer is a DynamicLayer
        return BatchingPlan(True, "transformers builds plain dynamic caches")
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) not in _MERGEABLE_LAYERS})
    if odd:
        return BatchingPlan(False, f"cache layers {odd} hold more than per-token keys and values")
    return BatchingPlan(True, "attention layers only (full or sliding window)")


def new_cache(model: Any, continuous: bool) -> DynamicCache:
    """An empty cache: config-less (full layers) for continuous batching, else the model's own layout."""
    config = getattr(model, "config", None)
    if continuous or config is None:
        return DynamicCache()
    return DynamicCache(config=config)


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, checked to be plain full layers holding 4-D tensors (what the surgery assumes)."""
    for layer in cache.layers:
        if type(layer) is not DynamicLayer or layer.keys is None or layer.keys.dim() != 4:
            raise RuntimeError(
                f"continuous batching needs full DynamicLayer caches with (B, H, T, D) tensors; the model made "
                f"{type(layer).__name__}"
            )
    return list(cache.layers)


def select_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep (or repeat) rows ``index`` (R,) of every layer, in place; repeating expands a shared prefill."""
    for layer in _layers(cache):
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)


def _pad_left(t: torch.Tensor, columns: int) -> torch.Tensor:
    """``t`` (B, H, T, D) with ``columns`` zero columns prepended: (B, H, columns + T, D)."""
    if columns == 0:
        return t
    pad = t.new_zeros((t.shape[0], t.shape[1], columns, t.shape[3]))
    return torch.cat([pad, t], dim=2)


def concat_rows(into: DynamicCache, width: int, other: DynamicCache, other_width: int) -> None:
    """Append ``other``'s rows to ``into`` (in place), left-padding whichever is narrower to the common width."""
    total = max(width, other_width)
    for mine, theirs in zip(_layers(into), _layers(other), strict=True):
        mine.keys = torch.cat([_pad_left(mine.keys, total - width), _pad_left(theirs.keys, total - other_width)])
        mine.values = torch.cat([_pad_left(mine.values, total - width), _pad_left(theirs.values, total - other_width)])


def trim_left(cache: DynamicCache, columns: int) -> None:
    """Drop the first ``columns`` sequence columns (padding in every row) of every layer, in place."""
    if columns == 0:
        return
    for layer in _layers(cache):
        layer.keys = layer.keys[:, :, columns:, :]
        layer.values = layer.values[:, :, columns:, :]


def zero_padding(cache: DynamicCache, mask: torch.Tensor) -> None:
    """Zero the keys and values of padding columns (``mask`` (B, T) == 0), in place.

    They are masked out of attention, but a masked weight is an exact 0 only against finite values: a
    padding query attends to nothing, which some attention kernels answer with NaN, and 0 * NaN is NaN.
    """
    keep = mask.bool()[:, None, :, None]  # (B, 1, T, 1)
    for layer in _layers(cache):
        layer.keys = layer.keys.masked_fill(~keep, 0.0)
        layer.values = layer.values.masked_fill(~keep, 0.0)
