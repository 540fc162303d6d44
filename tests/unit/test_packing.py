"""Right-padded layout of prompt + output, and micro-batch padding across ranks."""

from __future__ import annotations

import pytest
import torch

from miles.backends.base import TrainSample
from miles.backends.packing import micro_batches, num_micro_batches, pack


def _sample(prompt: list[int], output: list[int], adv: float = 1.0) -> TrainSample:
    return TrainSample(prompt, output, [-0.5 * (i + 1) for i in range(len(output))], adv, 0)


def test_layout() -> None:
    batch = pack([_sample([1, 2], [3, 4, 5], 2.0), _sample([6, 7, 8], [9], -1.0)], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.targets.tolist() == [[2, 3, 4, 5], [7, 8, 9, 0]]
    # targets that are output tokens: row 0 -> 3, 4, 5; row 1 -> 9
    assert batch.loss_mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert batch.behaviour_logp.tolist() == [[0, -0.5, -1.0, -1.5], [0, 0, -0.5, 0]]
    assert batch.advantages.tolist() == [2.0, -1.0]
    assert (batch.num_tokens, batch.num_sequences) == (4, 2)
    assert batch.per_sample(batch.behaviour_logp) == [[-0.5, -1.0, -1.5], [-0.5]]


def test_empty_output_and_empty_batch() -> None:
    batch = pack([_sample([1], []), _sample([1], [2])], pad_token_id=0)
    assert (batch.num_tokens, batch.num_sequences) == (1, 1)
    assert batch.per_sample(batch.loss_mask) == [[], [1.0]]
    dummy = pack([], pad_token_id=0)
    assert dummy.loss_mask.sum() == 0 and dummy.attention_mask.all()
    assert (dummy.num_tokens, dummy.num_sequences) == (0, 0)


def test_rejects_inconsistent_samples() -> None:
    with pytest.raises(ValueError, match="behaviour"):
        pack([TrainSample([1], [2, 3], [-1.0], 1.0, 0)], pad_token_id=0)
    scoring = pack([TrainSample([1], [2, 3], [], 0.0, 0)], pad_token_id=0, require_behaviour=False)
    assert scoring.behaviour_logp.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="empty prompt"):
        pack([TrainSample([], [2], [-1.0], 1.0, 0)], pad_token_id=0)


def test_micro_batches_pad_to_common_count() -> None:
    samples = [_sample([1], [2]) for _ in range(5)]
    assert [len(c) for c in micro_batches(samples, 2)] == [2, 2, 1]
    assert [len(c) for c in micro_batches(samples, 2, count=4)] == [2, 2, 1, 0]
    assert [len(c) for c in micro_batches(samples, None)] == [5]
    assert [len(c) for c in micro_batches([], 3, count=2)] == [0, 0]
    assert num_micro_batches(5, 2) == 3 and num_micro_batches(0, 2) == 1 and num_micro_batches(7, None) == 1
    with pytest.raises(ValueError):
        micro_batches(samples, 2, count=2)
    assert isinstance(pack(micro_batches(samples, 2)[0], 0).input_ids, torch.Tensor)
