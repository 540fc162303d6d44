"""From episodes to micro-batches: data-parallel shards, sequence packing, and per-token tensors.

Layout (:class:`miles.backends.base.MicroBatch`): each row holds one or more whole sequences
(``prompt + token_ids``) back to back, right-padded; position ids restart at 0 at every sequence, which is
how the model keeps packed sequences apart (transformers builds a block-diagonal mask from them). Position
``t`` of a sequence predicts its token ``t + 1``; a sequence's last position predicts nothing. Completion
token ``k`` of a sample with a prompt of ``P`` tokens sits at position ``P + k`` and is predicted at
``P + k - 1``, where its loss mask, advantage and behaviour log-prob are placed.

Packing is first-fit decreasing into rows as long as the longest sequence, so no sequence is ever split and
attention cost stays that of the longest sequence; micro-batches are then cut by a token budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles.backends.base import MicroBatch, SampleSpan, TrainSample


def seq_len(sample: TrainSample) -> int:
    return len(sample.prompt_ids) + len(sample.token_ids)


def shard_for_data_parallel(samples: Sequence[TrainSample], dp_size: int) -> list[list[TrainSample]]:
    """Split a batch over ``dp_size`` ranks, balanced by tokens (longest first onto the lightest rank).

    Returns one list per rank; a rank may get none when there are fewer samples than ranks.
    """
    shards: list[list[TrainSample]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for sample in sorted(samples, key=seq_len, reverse=True):
        rank = min(range(dp_size), key=lambda r: (loads[r], len(shards[r])))
        shards[rank].append(sample)
        loads[rank] += seq_len(sample)
    return shards


@dataclass(slots=True)
class _Row:
    capacity: int
    members: list[int]  # sample indices, in placement order
    used: int = 0


def _rows(samples: Sequence[TrainSample], pack: bool) -> list[_Row]:
    """Rows of sample indices: first-fit decreasing into rows of the longest sequence's length."""
    if not samples:
        return []
    capacity = max(seq_len(s) for s in samples)
    rows: list[_Row] = []
    for i in sorted(range(len(samples)), key=lambda i: seq_len(samples[i]), reverse=True):
        n = seq_len(samples[i])
        row = next((r for r in rows if r.used + n <= r.capacity), None) if pack else None
        if row is None:
            row = _Row(capacity, [])
            rows.append(row)
        row.members.append(i)
        row.used += n
    return rows


def _group_rows(rows: list[_Row], token_budget: int | None) -> list[list[_Row]]:
    """Consecutive rows per micro-batch, at most ``token_budget`` positions (rows x longest row), >= 1 row."""
    if token_budget is None:
        return [rows] if rows else []
    groups: list[list[_Row]] = []
    for row in rows:
        if groups:
            width = max(r.used for r in groups[-1] + [row])
            if width * (len(groups[-1]) + 1) <= token_budget:
                groups[-1].append(row)
                continue
        groups.append([row])
    return groups


def _advantages(sample: TrainSample) -> list[float]:
    if isinstance(sample.advantage, list):
        return [float(a) for a in sample.advantage]
    return [float(sample.advantage)] * len(sample.token_ids)


def _build(samples: Sequence[TrainSample], rows: list[_Row], pad_id: int, device: torch.device | str) -> MicroBatch:
    width = max(2, max(r.used for r in rows))
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)  # (R, L)
    position_ids = torch.zeros(shape, dtype=torch.long)  # (R, L)
    targets = torch.full(shape, pad_id, dtype=torch.long)  # (R, L)
    loss_mask = torch.zeros(shape)  # (R, L)
    seq_index = torch.full(shape, -1, dtype=torch.long)  # (R, L)
    names = ("advantages", "behaviour_logp", "teacher_logp")
    per_token = {name: torch.zeros(shape) for name in names}
    has_teacher = any(samples[i].teacher_logprobs is not None for row in rows for i in row.members)
    spans: list[SampleSpan] = []
    seq = 0
    for r, row in enumerate(rows):
        offset = 0
        for i in row.members:
            s = samples[i]
            ids = list(s.prompt_ids) + list(s.token_ids)
            n, p, k = len(ids), len(s.prompt_ids), len(s.token_ids)
            input_ids[r, offset : offset + n] = torch.tensor(ids, dtype=torch.long)
            position_ids[r, offset : offset + n] = torch.arange(n)
            targets[r, offset : offset + n - 1] = torch.tensor(ids[1:], dtype=torch.long)
            seq_index[r, offset : offset + n - 1] = seq
            first = offset + p - 1  # the position that predicts completion token 0
            if k:
                loss_mask[r, first : first + k] = torch.tensor(s.loss_mask, dtype=torch.float32)
                per_token["advantages"][r, first : first + k] = torch.tensor(_advantages(s))
                if s.behaviour_logprobs:
                    per_token["behaviour_logp"][r, first : first + k] = torch.tensor(s.behaviour_logprobs)
                if s.teacher_logprobs is not None:
                    per_token["teacher_logp"][r, first : first + k] = torch.tensor(s.teacher_logprobs)
            spans.append(SampleSpan(sample=i, row=r, start=first, length=k, trained=any(s.loss_mask)))
            offset += n
            seq += 1
    # Padding gets its own position run, so that it forms a segment of its own (never attended to by a sequence).
    for r, row in enumerate(rows):
        if row.used < width:
            position_ids[r, row.used :] = torch.arange(width - row.used)
    if not has_teacher:
        del per_token["teacher_logp"]
    return MicroBatch(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        targets=targets.to(device),
        loss_mask=loss_mask.to(device),
        seq_index=seq_index.to(device),
        tensors={name: t.to(device) for name, t in per_token.items()},
        spans=spans,
    )


def empty_micro_batch(pad_id: int, device: torch.device | str = "cpu") -> MicroBatch:
    """A one-row batch with nothing to train: a rank with no data still runs every collective forward."""
    shape = (1, 2)
    zeros = torch.zeros(shape, device=device)
    return MicroBatch(
        input_ids=torch.full(shape, pad_id, dtype=torch.long, device=device),
        position_ids=torch.arange(2, device=device).unsqueeze(0),
        targets=torch.full(shape, pad_id, dtype=torch.long, device=device),
        loss_mask=zeros.clone(),
        seq_index=torch.full(shape, -1, dtype=torch.long, device=device),
        tensors={"advantages": zeros.clone(), "behaviour_logp": zeros.clone()},
    )


def pack_micro_batches(
    samples: Sequence[TrainSample],
    *,
    pad_id: int,
    device: torch.device | str = "cpu",
    token_budget: int | None = None,
    pack: bool = True,
) -> list[MicroBatch]:
    """Micro-batches of ``samples`` (at most ``token_budget`` positions each, None: one); ``spans`` index
    into ``samples``. An empty ``samples`` gives no micro-batch (see :func:`pad_to`)."""
    rows = _rows(samples, pack)
    return [_build(samples, group, pad_id, device) for group in _group_rows(rows, token_budget)]


def pad_to(batches: list[MicroBatch], count: int, pad_id: int, device: torch.device | str = "cpu") -> list[MicroBatch]:
    """Append empty micro-batches up to ``count`` (every data-parallel rank must run as many)."""
    if count < len(batches):
        raise ValueError(f"count {count} is below the {len(batches)} micro-batches needed")
    return batches + [empty_micro_batch(pad_id, device) for _ in range(count - len(batches))]
