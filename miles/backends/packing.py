"""Turning trajectories into right-padded token tensors for a causal-LM forward.

Layout: row ``b`` is ``prompt + output`` followed by padding. Logits at position ``t`` predict the
token at ``t + 1``, so every per-token tensor below is ``(B, T - 1)`` and aligned with ``targets``;
the loss mask is 1 exactly where the target is an output (completion) token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.backends.base import TrainSample


@dataclass(slots=True)
class PackedBatch:
    input_ids: Tensor  # (B, T) long, right-padded with pad_token_id
    attention_mask: Tensor  # (B, T) long, 1 on real tokens
    targets: Tensor  # (B, T-1) long, input_ids shifted left
    loss_mask: Tensor  # (B, T-1) float, 1 where the target is an output token
    advantages: Tensor  # (B,) float
    behaviour_logp: Tensor  # (B, T-1) float, engine log-probs at output positions, 0 elsewhere
    output_lengths: list[int]  # per row, to cut per-token results back into per-sample lists

    @property
    def num_tokens(self) -> int:
        return sum(self.output_lengths)

    @property
    def num_sequences(self) -> int:
        """Rows that contribute to a per-sequence mean (at least one output token)."""
        return sum(1 for n in self.output_lengths if n > 0)

    def per_sample(self, values: Tensor) -> list[list[float]]:
        """Cut a ``(B, T-1)`` per-token tensor back into one list per sample (output tokens only)."""
        rows: list[list[float]] = []
        mask = self.loss_mask.bool()
        for b, n in enumerate(self.output_lengths):
            row = values[b][mask[b]].tolist() if n else []
            rows.append(row)
        return rows


def pack(
    samples: Sequence[TrainSample],
    pad_token_id: int,
    device: torch.device | str = "cpu",
    *,
    require_behaviour: bool = True,
) -> PackedBatch:
    """Right-pad ``samples`` into one batch.

    With ``require_behaviour=False`` (scoring only) samples may omit behaviour log-probs; they are
    then zeros in the batch.

    An empty ``samples`` gives a one-row dummy batch with an all-zero loss mask: in data-parallel
    training every rank must run the same number of forwards and backwards (FSDP's all-gathers and
    reduce-scatters are collective), even a rank that has nothing to train on this time.
    """
    if not samples:
        ids = torch.full((1, 2), pad_token_id, dtype=torch.long)
        return PackedBatch(
            input_ids=ids.to(device),
            attention_mask=torch.ones_like(ids).to(device),  # all-masked rows would give NaN attention
            targets=ids[:, 1:].to(device),
            loss_mask=torch.zeros((1, 1), device=device),
            advantages=torch.zeros(1, device=device),
            behaviour_logp=torch.zeros((1, 1), device=device),
            output_lengths=[0],
        )

    for i, s in enumerate(samples):
        if (require_behaviour or s.behaviour_logprobs) and len(s.behaviour_logprobs) != len(s.output_ids):
            raise ValueError(
                f"sample {i}: {len(s.behaviour_logprobs)} behaviour log-probs for {len(s.output_ids)} output tokens"
            )
        if not s.prompt_ids:
            raise ValueError(f"sample {i}: empty prompt (the first output token needs a context)")

    batch, width = len(samples), max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    width = max(width, 2)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros((batch, width - 1))  # (B, T-1)
    behaviour = torch.zeros((batch, width - 1))  # (B, T-1)
    for b, s in enumerate(samples):
        p, o = len(s.prompt_ids), len(s.output_ids)
        input_ids[b, : p + o] = torch.tensor(list(s.prompt_ids) + list(s.output_ids), dtype=torch.long)
        attention_mask[b, : p + o] = 1
        # Output token k sits at input position p + k and is predicted by logits at p + k - 1.
        loss_mask[b, p - 1 : p - 1 + o] = 1.0
        if o and s.behaviour_logprobs:
            behaviour[b, p - 1 : p - 1 + o] = torch.tensor(list(s.behaviour_logprobs), dtype=torch.float32)
    advantages = torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32)  # (B,)
    return PackedBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        targets=input_ids[:, 1:].to(device),
        loss_mask=loss_mask.to(device),
        advantages=advantages.to(device),
        behaviour_logp=behaviour.to(device),
        output_lengths=[len(s.output_ids) for s in samples],
    )


def micro_batches(
    samples: Sequence[TrainSample], size: int | None, count: int | None = None
) -> list[list[TrainSample]]:
    """Split ``samples`` into chunks of ``size`` (``None``: one chunk), padded with empty chunks to ``count``.

    ``count`` is the largest chunk count over the data-parallel ranks, so every rank runs the same
    number of (possibly dummy) forwards.
    """
    chunks = [list(samples)] if size is None else [list(samples[i : i + size]) for i in range(0, len(samples), size)]
    if not chunks:
        chunks = [[]]
    if count is not None:
        if count < len(chunks):
            raise ValueError(f"count {count} is below the {len(chunks)} chunks needed")
        chunks += [[] for _ in range(count - len(chunks))]
    return chunks


def num_micro_batches(num_samples: int, size: int | None) -> int:
    """How many chunks :func:`micro_batches` makes before padding (at least one)."""
    if size is None or num_samples == 0:
        return 1
    return -(-num_samples // size)
