"""From episodes to micro-batches: data-parallel shards, sequence packing, and per-token tensors.

Layout (:class:`miles.backends.base.MicroBatch`): each row holds one or more whole sequences
(``prompt + token_ids``) back to back, right-padded; position ids restart at 0 at every sequence, which is
how the model keeps packed sequences apart (transformers builds a block-diagonal mask from them). Position
``t`` of a sequence predicts its token ``t + 1``; a sequence's last position predicts nothing. Completion
token ``k`` of a sample with a prompt of ``P`` tokens sits at position ``P + k`` and is predicted at
``P + k - 1``, where its loss mask, advantage and behaviour log-prob are placed.

Packing is first-fit decreasing into rows as long as the longest sequence, so no sequence is ever split and
attention cost stays that of the longest sequence; micro-batches are then cut by a token budget.

Shared prompts (``share_prompts``, for backends whose model honours a custom attention mask): the samples of a
GRPO group start with the same prompt, which plain packing computes once per sample. A *block* holds the
prompt's first ``P - 1`` tokens once (positions ``0 .. P-2``), then per sample a segment: the last prompt
token and the completion (positions from ``P - 1``, exactly as in the sample's own sequence). Each segment
attends to the block's prefix and, causally, to itself; nothing else (``attention_mask``, ``(R, 1, L, L)``
bool). Every log-prob is the one the sample's own sequence gives (the prefix's hidden states depend on the
prefix alone), and the prefix's gradient is the sum of its samples', as when each had its own copy; a
quickstart group of 8 then costs 42 positions instead of 84. A lone sample's block is its plain sequence, so
without a common prompt nothing changes. Blocks stay within ``max(longest sequence, SHARED_BLOCK_TOKENS)``
positions (the mask is dense: ``L x L`` per row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.backends.base import MicroBatch, SampleSpan, TrainSample

SHARED_BLOCK_TOKENS = 512  # positions of a shared-prompt block at most (beyond the longest plain sequence)


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
class _Block:
    """Samples behind one copy of their common prompt (one sample: exactly its own sequence)."""

    members: list[int]  # sample indices
    length: int  # positions: the prompt's first P - 1 tokens, then 1 + len(token_ids) per member


@dataclass(slots=True)
class _Row:
    capacity: int
    blocks: list[_Block]  # in placement order
    used: int = 0


def _blocks(samples: Sequence[TrainSample], share: bool) -> list[_Block]:
    """One block per sample, or with ``share`` the samples of each distinct prompt in as few blocks as fit."""
    if not share:
        return [_Block([i], seq_len(s)) for i, s in enumerate(samples)]
    cap = max(max(seq_len(s) for s in samples), SHARED_BLOCK_TOKENS)
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(i)
    blocks: list[_Block] = []
    for prompt, members in by_prompt.items():
        block: _Block | None = None
        for i in members:
            n = 1 + len(samples[i].token_ids)
            if block is None or block.length + n > cap:
                block = _Block([], len(prompt) - 1)
                blocks.append(block)
            block.members.append(i)
            block.length += n
    return blocks


def _rows(samples: Sequence[TrainSample], pack: bool, share: bool = False) -> list[_Row]:
    """Rows of blocks: first-fit decreasing into rows of the longest block's length."""
    if not samples:
        return []
    blocks = _blocks(samples, share)
    capacity = max(b.length for b in blocks)
    rows: list[_Row] = []
    for block in sorted(blocks, key=lambda b: b.length, reverse=True):
        row = next((r for r in rows if r.used + block.length <= r.capacity), None) if pack else None
        if row is None:
            row = _Row(capacity, [])
            rows.append(row)
        row.blocks.append(block)
        row.used += block.length
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
    has_teacher = any(samples[i].teacher_logprobs is not None for row in rows for b in row.blocks for i in b.members)
    shared = any(len(b.members) > 1 for row in rows for b in row.blocks)
    names = ("advantages", "behaviour_logp", "teacher_logp") if has_teacher else ("advantages", "behaviour_logp")
    fields: dict[str, list[list[float]] | list[list[int]]] = {
        name: [] for name in ("input_ids", "position_ids", "targets", "seq_index", "loss_mask", *names)
    }
    # Per position, with shared prompts: the block (-1: padding) and the segment (0: the block's prefix).
    block_ids: list[list[int]] = []
    segment_ids: list[list[int]] = []
    spans: list[SampleSpan] = []
    seq = 0
    for r, row in enumerate(rows):
        ids: list[int] = []
        positions: list[int] = []
        targets: list[int] = []
        seq_index: list[int] = []
        blocks: list[int] = []
        segments: list[int] = []
        per_token = {name: [0.0] * width for name in ("loss_mask", *names)}
        for b, block in enumerate(row.blocks):
            prompt = samples[block.members[0]].prompt_ids
            p = len(prompt)
            ids += prompt[:-1]
            positions += range(p - 1)
            targets += prompt[1:]
            # A lone sample's prompt positions belong to its sequence; a shared prefix to none of them.
            seq_index += [seq if len(block.members) == 1 else -1] * (p - 1)
            blocks += [b] * (p - 1)
            segments += [0] * (p - 1)
            for j, i in enumerate(block.members, start=1):
                s = samples[i]
                k = len(s.token_ids)
                first = len(ids)  # the last prompt token: it predicts completion token 0
                ids.append(prompt[-1])
                ids += s.token_ids
                positions += range(p - 1, p + k)
                targets += s.token_ids
                targets.append(pad_id)  # a sequence's last position predicts nothing
                seq_index += [seq] * k
                seq_index.append(-1)
                blocks += [b] * (k + 1)
                segments += [j] * (k + 1)
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
        block_ids.append(blocks + [-1] * pad)
        segment_ids.append(segments + [0] * pad)
    long = {"input_ids", "position_ids", "targets", "seq_index"}
    t = {
        name: torch.tensor(values, dtype=torch.long if name in long else torch.float32, device=device)
        for name, values in fields.items()
    }
    mask = _shared_prompt_mask(block_ids, segment_ids, device) if shared else None
    return MicroBatch(
        input_ids=t["input_ids"],
        position_ids=t["position_ids"],
        targets=t["targets"],
        loss_mask=t["loss_mask"],
        seq_index=t["seq_index"],
        tensors={name: t[name] for name in names},
        spans=spans,
        attention_mask=mask,
    )


def _shared_prompt_mask(block_ids: list[list[int]], segment_ids: list[list[int]], device: torch.device | str) -> Tensor:
    """``(R, 1, L, L)`` bool, True where query position ``q`` may attend to ``kv``: causal, within one block, to the
    block's prefix or to its own segment. Padding attends to padding before it (never to nothing: no NaN)."""
    block = torch.tensor(block_ids, dtype=torch.long, device=device)  # (R, L)
    segment = torch.tensor(segment_ids, dtype=torch.long, device=device)  # (R, L)
    length = block.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()  # (L, L): kv <= q
    same_block = block.unsqueeze(2) == block.unsqueeze(1)  # (R, L, L)
    visible = (segment.unsqueeze(1) == 0) | (segment.unsqueeze(2) == segment.unsqueeze(1))  # (R, L, L)
    return (causal & same_block & visible).unsqueeze(1)


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
    share_prompts: bool = False,
) -> list[MicroBatch]:
    """Micro-batches of ``samples`` (at most ``token_budget`` positions each, None: one); ``spans`` index
    into ``samples``. An empty ``samples`` gives no micro-batch (see :func:`pad_to`). ``share_prompts``: the
    samples of one prompt behind one copy of it (module docstring); only for a backend that applies
    :attr:`MicroBatch.attention_mask`."""
    rows = _rows(samples, pack, share_prompts)
    return [_build(samples, group, pad_id, device) for group in _group_rows(rows, token_budget)]


def pad_to(batches: list[MicroBatch], count: int, pad_id: int, device: torch.device | str = "cpu") -> list[MicroBatch]:
    """Append empty micro-batches up to ``count`` (every data-parallel rank must run as many)."""
    if count < len(batches):
        raise ValueError(f"count {count} is below the {len(batches)} micro-batches needed")
    return batches + [empty_micro_batch(pad_id, device) for _ in range(count - len(batches))]
