"""Per-sequence reductions over packed token tensors.

A micro-batch row may hold several sequences back to back (:class:`miles.backends.base.MicroBatch`), so
"per sequence" cannot mean "per row". ``seq_index`` ``(R, L)`` names the sequence each target token
belongs to (``0 .. S-1`` within the micro-batch, ``-1`` where there is none); these helpers reduce over it
and broadcast back. Every function is differentiable in its values.
"""

from __future__ import annotations

import torch
from torch import Tensor


def num_segments(seq_index: Tensor) -> int:
    """Sequences in a micro-batch: ``max(seq_index) + 1`` (0 for an all-padding batch)."""
    return int(seq_index.max().item()) + 1 if seq_index.numel() else 0


def segment_sum(values: Tensor, seq_index: Tensor, count: int) -> Tensor:
    """``(R, L)`` values summed per sequence -> ``(count,)``; positions with ``seq_index < 0`` are ignored."""
    valid = seq_index >= 0  # (R, L)
    out = values.new_zeros(count)
    return out.index_add(0, seq_index[valid], values[valid])


def broadcast(per_seq: Tensor, seq_index: Tensor) -> Tensor:
    """``(S,)`` per-sequence values back onto their tokens -> ``(R, L)``, 0 where ``seq_index < 0``."""
    if per_seq.numel() == 0:
        return per_seq.new_zeros(seq_index.shape)
    picked = per_seq[seq_index.clamp(min=0)]  # (R, L)
    return torch.where(seq_index >= 0, picked, picked.new_zeros(()))


def rows_as_sequences(mask: Tensor) -> Tensor:
    """The ``seq_index`` of an unpacked batch: row ``b`` is sequence ``b`` wherever ``mask`` is set."""
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1).expand_as(mask)  # (B, T)
    return torch.where(mask > 0, rows, torch.full_like(rows, -1))
