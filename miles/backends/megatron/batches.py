"""Miles' packed rows (:class:`~miles.backends.base.MicroBatch`) as megatron-core model inputs.

A Miles row holds whole sequences back to back, ``position_ids`` restarting at 0 at each; position ``t``
predicts ``targets[r, t]``. Two layouts reproduce per-sequence attention exactly:

* ``mask`` (default without TransformerEngine): the rows as they are, right-padded to a multiple of the
  sequence-parallel size, with a causal **block-diagonal** boolean mask ``(R, 1, S, S)``. RoPE runs on
  row positions, not on the restarted ones: attention scores depend only on ``q_pos - k_pos`` inside one
  sequence, which the block mask never crosses, so the result is the same up to rounding. Costs
  ``O(S^2)`` memory per row; for short RL rows it is the simple, portable path (all of it runs on CPU).
* ``thd`` (needs TransformerEngine; the only layout for context parallelism): every sequence of the
  micro-batch concatenated into one row, described by ``cu_seqlens`` (megatron's ``PackedSeqParams``),
  each sequence padded to a multiple of ``2 * cp`` (and the total to a multiple of ``tp``); with
  ``cp > 1`` rank ``k`` holds chunks ``k`` and ``2cp - 1 - k`` of each sequence (TE's load-balanced
  split). :class:`McoreBatch.scatter` puts per-token results back into the ``(R, L)`` grid.

Trailing tokens of a row whose target belongs to no sequence (``seq_index == -1``: padding, and the last
token of the row's last sequence) are dropped in ``thd``: nothing is predicted from them and, being last,
no kept token attends to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from miles.backends.base import MicroBatch


@dataclass(slots=True)
class McoreBatch:
    """Model inputs of one micro-batch on this rank, and the way back to Miles' ``(R, L)`` grid."""

    input_ids: Tensor  # (B, S) long
    position_ids: Tensor  # (B, S) long
    targets: Tensor  # (B, S) long, the target of each input position (0 on padding)
    attention_mask: Tensor | None  # (B, 1, S, S) bool, True = masked; None for thd
    packed_seq_params: Any | None  # megatron PackedSeqParams for thd
    scatter: Callable[[Tensor], Tensor]  # (B, S) per-token values -> (R, L), zeros where not computed


def segment_ids(position_ids: Tensor) -> Tensor:
    """``(R, L)`` index of the sequence each token belongs to within its row (a new one at position 0)."""
    starts = (position_ids == 0).long()
    starts[:, 0] = 1
    return starts.cumsum(dim=1) - 1


def block_causal_mask(position_ids: Tensor) -> Tensor:
    """``(R, 1, L, L)`` bool, True where query ``i`` may **not** attend key ``j`` (``j > i`` or another
    sequence)."""
    seg = segment_ids(position_ids)  # (R, L)
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).triu(1)  # (L, L)
    other = seg.unsqueeze(2) != seg.unsqueeze(1)  # (R, L, L)
    return (causal.unsqueeze(0) | other).unsqueeze(1)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def mask_layout(mb: MicroBatch, multiple: int = 1, pad_token_id: int = 0) -> McoreBatch:
    """The ``mask`` layout; ``multiple``: the padded length's divisor (the TP size with sequence parallel)."""
    rows, length = mb.input_ids.shape
    padded = _round_up(length, multiple)
    extra = padded - length

    def pad(t: Tensor, value: int) -> Tensor:
        return torch.nn.functional.pad(t, (0, extra), value=value) if extra else t

    position_ids = pad(mb.position_ids, 0)
    return McoreBatch(
        input_ids=pad(mb.input_ids, pad_token_id),
        position_ids=position_ids,
        targets=pad(mb.targets, 0),
        attention_mask=block_causal_mask(position_ids),
        packed_seq_params=None,
        scatter=lambda values: values[:, :length],
    )


@dataclass(frozen=True, slots=True)
class ThdPlan:
    """Where each packed token comes from: ``source[i]`` is the flat ``(R * L)`` index of packed token ``i``
    (-1 on padding); ``cu_seqlens`` (padded lengths) delimit the sequences."""

    source: Tensor  # (T,) long
    cu_seqlens: Tensor  # (N + 1,) int32
    max_seqlen: int


def thd_plan(mb: MicroBatch, cp: int = 1, tp: int = 1) -> ThdPlan:
    """Concatenate the sequences of ``mb`` (see the module docstring for the padding rules)."""
    rows, length = mb.input_ids.shape
    seg = segment_ids(mb.position_ids)
    valid = mb.seq_index >= 0
    sources: list[Tensor] = []
    lengths: list[int] = []
    for r in range(rows):
        hits = valid[r].nonzero()
        if hits.numel() == 0:
            continue
        keep = int(hits.max().item()) + 1  # drop the trailing tokens that predict nothing
        for s in torch.unique(seg[r, :keep]).tolist():
            idx = (seg[r, :keep] == s).nonzero().flatten() + r * length
            n = _round_up(idx.numel(), 2 * cp)
            sources.append(torch.cat([idx, idx.new_full((n - idx.numel(),), -1)]))
            lengths.append(n)
    total = sum(lengths)
    tail = _round_up(max(total, 1), 2 * cp * tp) - total  # a padding "sequence" for the TP / CP divisors
    if tail:
        sources.append(torch.full((tail,), -1, dtype=torch.long))
        lengths.append(tail)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ThdPlan(source=torch.cat(sources), cu_seqlens=cu, max_seqlen=max(lengths))


def cp_token_index(plan: ThdPlan, cp: int, cp_rank: int) -> Tensor:
    """Packed positions this CP rank holds: chunks ``cp_rank`` and ``2cp - 1 - cp_rank`` of every sequence."""
    if cp == 1:
        return torch.arange(plan.source.numel())
    picks = []
    bounds = plan.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        chunk = (end - start) // (2 * cp)
        for c in (cp_rank, 2 * cp - 1 - cp_rank):
            picks.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(picks)


def thd_layout(
    mb: MicroBatch,
    *,
    cp: int = 1,
    cp_rank: int = 0,
    tp: int = 1,
    pad_token_id: int = 0,
    gather_cp: Callable[[Tensor], Tensor] | None = None,
) -> McoreBatch:
    """The ``thd`` layout on CP rank ``cp_rank``. ``gather_cp`` all-gathers a ``(1, T / cp)`` tensor over the
    CP group into ``(cp, T / cp)`` (differentiably; None for cp == 1)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    plan = thd_plan(mb, cp, tp)
    rows, length = mb.input_ids.shape
    local = cp_token_index(plan, cp, cp_rank)
    src = plan.source[local]  # (T / cp,)
    real = src >= 0
    safe = src.clamp(min=0).to(mb.input_ids.device)

    def take(t: Tensor, fill: int) -> Tensor:
        return torch.where(real.to(t.device), t.flatten()[safe], torch.full_like(safe, fill)).unsqueeze(0)

    cu = plan.cu_seqlens.to(mb.input_ids.device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=plan.max_seqlen,
        max_seqlen_kv=plan.max_seqlen,
    )
    order = torch.cat([cp_token_index(plan, cp, k) for k in range(cp)]) if cp > 1 else local

    def scatter(values: Tensor) -> Tensor:  # (1, T / cp) -> (R, L)
        full = values if gather_cp is None else gather_cp(values).reshape(1, -1)  # (1, T) in CP-rank order
        sources = plan.source[order].to(values.device)
        keep = sources >= 0
        out = values.new_zeros(rows * length)
        out = out.index_put((sources[keep],), full[0][keep.nonzero().flatten()])
        return out.reshape(rows, length)

    return McoreBatch(
        input_ids=take(mb.input_ids, pad_token_id),
        position_ids=take(mb.position_ids, 0),
        targets=take(mb.targets, 0),
        attention_mask=None,
        packed_seq_params=params,
        scatter=scatter,
    )
