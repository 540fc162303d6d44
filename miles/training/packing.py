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
    # Rows are built as Python lists and become one tensor per field: a small slice write per sample and
    # field costs more than the whole list (about 3x, benchmarks/trainer_step_cost.py on the quickstart).
    width = max(2, max(r.used for r in rows))
    has_teacher = any(samples[i].teacher_logprobs is not None for row in rows for i in row.members)
    names = ("advantages", "behaviour_logp", "teacher_logp") if has_teacher else ("advantages", "behaviour_logp")
    fields: dict[str, list[list[float]] | list[list[int]]] = {
        name: [] for name in ("input_ids", "position_ids", "targets", "seq_index", "loss_mask", *names)
    }
    spans: list[SampleSpan] = []
    seq = 0
    for r, row in enumerate(rows):
        ids: list[int] = []
        positions: list[int] = []
        targets: list[int] = []
        seq_index: list[int] = []
        per_token = {name: [0.0] * width for name in ("loss_mask", *names)}
        for i in row.members:
            s = samples[i]
            full = [*s.prompt_ids, *s.token_ids]
            n, p, k = len(full), len(s.prompt_ids), len(s.token_ids)
            first = len(ids) + p - 1  # the position that predicts completion token 0
            ids += full
            positions += range(n)
            targets += full[1:]
            targets.append(pad_id)  # a sequence's last position predicts nothing
            seq_index += [seq] * (n - 1)
            seq_index.append(-1)
            if k:
                per_token["loss_mask"][first : first + k] = [float(m) for m in s.loss_mask]
                per_token["advantages"][first : first + k] = _advantages(s)
                if s.behaviour_logprobs:
                    per_token["behaviour_logp"][first : first + k] = s.behaviour_logprobs
                if has_teacher and s.teacher_logprobs is not None:
                    per_token["teacher_logp"][first : first + k] = s.teacher_logprobs
            spans.append(SampleSpan(sample=i, row=r, start=first, length=k, trained=any(s.loss_mask)))
            seq += 1
        pad = width - len(ids)
        fields["input_ids"].append(ids + [pad_id] * pad)
        # Padding gets its own position run, so that it forms a segment of its own (never attended to).
        fields["position_ids"].append(positions + list(range(pad)))
        fields["targets"].append(targets + [pad_id] * pad)
        fields["seq_index"].append(seq_index + [-1] * pad)
        for name, values in per_token.items():
            fields[name].append(values)
    long = {"input_ids", "position_ids", "targets", "seq_index"}
    t = {
        name: torch.tensor(values, dtype=torch.long if name in long else torch.float32, device=device)
        for name, values in fields.items()
    }
    return MicroBatch(
        input_ids=t["input_ids"],
        position_ids=t["position_ids"],
        targets=t["targets"],
        loss_mask=t["loss_mask"],
        seq_index=t["seq_index"],
        tensors={name: t[name] for name in names},
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
