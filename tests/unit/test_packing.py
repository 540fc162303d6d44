"""Packing episodes into micro-batches: layout, masks, data-parallel shards, micro-batch budgets."""

from __future__ import annotations

import pytest

from miles.backends.base import TrainSample
from miles.training.packing import pack_micro_batches, pad_to, shard_for_data_parallel


def _sample(prompt: list[int], tokens: list[int], mask: list[int] | None = None, adv: float = 1.0) -> TrainSample:
    mask = [1] * len(tokens) if mask is None else mask
    return TrainSample(prompt, tokens, mask, [-0.5 * (i + 1) * m for i, m in enumerate(mask)], adv)


def test_unpacked_layout() -> None:
    (mb,) = pack_micro_batches(
        [_sample([1, 2], [3, 4, 5], adv=2.0), _sample([6, 7, 8], [9], adv=-1.0)], pad_id=0, pack=False
    )
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0]]
    assert mb.targets.tolist() == [[2, 3, 4, 5, 0], [7, 8, 9, 0, 0]]
    # position t predicts the next token: completion tokens 3, 4, 5 at positions 1..3; 9 at position 2
    assert mb.loss_mask.tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]
    assert mb.seq_index.tolist() == [[0, 0, 0, 0, -1], [1, 1, 1, -1, -1]]
    assert mb.tensors["advantages"].tolist() == [[0, 2, 2, 2, 0], [0, 0, -1, 0, 0]]
    assert mb.tensors["behaviour_logp"].tolist() == [[0, -0.5, -1.0, -1.5, 0], [0, 0, -0.5, 0, 0]]
    assert (mb.num_tokens, mb.num_sequences) == (4, 2)
    assert mb.per_sample(mb.tensors["behaviour_logp"]) == {0: [-0.5, -1.0, -1.5], 1: [-0.5]}


def test_packed_rows_keep_sequences_apart() -> None:
    samples = [_sample([1, 2], [3, 4, 5, 6]), _sample([7], [8]), _sample([9], [10, 11])]
    (mb,) = pack_micro_batches(samples, pad_id=0)
    # the longest (6 tokens) fills a row; the two short ones share the second row
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [9, 10, 11, 7, 8, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 0]]
    assert mb.targets.tolist()[1] == [10, 11, 0, 8, 0, 0]  # a sequence's last position predicts nothing
    assert mb.seq_index.tolist()[1] == [1, 1, -1, 2, -1, -1]
    assert mb.loss_mask.tolist()[1] == [1, 1, 0, 1, 0, 0]
    assert mb.per_sample(mb.targets.float()) == {0: [3, 4, 5, 6], 2: [10, 11], 1: [8]}


def test_environment_tokens_are_not_trained() -> None:
    (mb,) = pack_micro_batches([_sample([1], [2, 3, 4, 5], mask=[1, 0, 0, 1])], pad_id=0)
    assert mb.loss_mask.tolist() == [[1, 0, 0, 1, 0]]
    assert mb.tensors["behaviour_logp"].tolist() == [[-0.5, 0, 0, -2.0, 0]]
    assert mb.tensors["advantages"].tolist() == [[1, 1, 1, 1, 0]]  # masked anyway


def test_token_budget_and_padding_to_a_common_count() -> None:
    samples = [_sample([1], [2, 3]) for _ in range(5)]  # 3 tokens each
    batches = pack_micro_batches(samples, pad_id=0, token_budget=6, pack=False)
    assert [mb.input_ids.shape[0] for mb in batches] == [2, 2, 1]
    padded = pad_to(batches, 4, pad_id=0)
    assert len(padded) == 4 and padded[-1].num_tokens == 0 and padded[-1].num_sequences == 0
    assert pack_micro_batches([], pad_id=0) == []
    with pytest.raises(ValueError):
        pad_to(batches, 2, pad_id=0)


def test_data_parallel_shards_balance_tokens() -> None:
    samples = [_sample([1], [2] * n) for n in (9, 1, 1, 1, 5, 4)]
    shards = shard_for_data_parallel(samples, 2)
    loads = [sum(len(s.prompt_ids) + len(s.token_ids) for s in shard) for shard in shards]
    assert sorted(loads) == [13, 14] and sum(len(s) for s in shards) == 6
    assert shard_for_data_parallel(samples[:1], 3)[1:] == [[], []]


def test_inconsistent_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        TrainSample([1], [2, 3], [1], [0.0, 0.0])
    with pytest.raises(ValueError, match="behaviour"):
        TrainSample([1], [2, 3], [1, 1], [0.0])
    with pytest.raises(ValueError, match="empty prompt"):
        TrainSample([], [2], [1], [0.0])


def test_shared_prompt_layout() -> None:
    """Two samples of prompt [1, 2, 3] behind one copy of it, a lone sample whole; the mask keeps them apart."""
    samples = [_sample([1, 2, 3], [4, 5]), _sample([6, 7], [8]), _sample([1, 2, 3], [9], adv=-1.0)]
    (mb,) = pack_micro_batches(samples, pad_id=0, share_prompts=True)
    # block of prompt [1, 2, 3]: prefix [1, 2], then [3, 4, 5] and [3, 9]; the lone sample in a row of its own
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 3, 9], [6, 7, 8, 0, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3], [0, 1, 2, 0, 1, 2, 3]]
    assert mb.targets.tolist()[0] == [2, 3, 4, 5, 0, 9, 0]
    assert mb.loss_mask.tolist()[0] == [0, 0, 1, 1, 0, 1, 0]
    assert mb.seq_index.tolist() == [[-1, -1, 0, 0, -1, 1, -1], [2, 2, -1, -1, -1, -1, -1]]
    assert mb.tensors["advantages"].tolist()[0] == [0, 0, 1, 1, 0, -1, 0]
    assert mb.per_sample(mb.tensors["behaviour_logp"]) == {0: [-0.5, -1.0], 2: [-0.5], 1: [-0.5]}
    allowed = mb.attention_mask
    assert allowed is not None and allowed.shape == (2, 1, 7, 7)
    # the second sample's segment (positions 5, 6) sees the prefix and itself, never the first sample's tokens
    assert allowed[0, 0, 6].tolist() == [True, True, False, False, False, True, True]
    assert allowed[0, 0, 4].tolist() == [True, True, True, True, True, False, False]
    assert allowed[1, 0, 2].tolist() == [True, True, True, False, False, False, False]
    assert allowed.diagonal(dim1=2, dim2=3).all()  # every position (padding too) sees something: no NaN


def test_shared_prompts_change_nothing_without_a_common_prompt() -> None:
    samples = [_sample([1, 2], [3, 4, 5, 6]), _sample([7], [8]), _sample([9], [10, 11])]
    (plain,) = pack_micro_batches(samples, pad_id=0)
    (shared,) = pack_micro_batches(samples, pad_id=0, share_prompts=True)
    assert shared.attention_mask is None
    for field in ("input_ids", "position_ids", "targets", "loss_mask", "seq_index"):
        assert getattr(shared, field).tolist() == getattr(plain, field).tolist(), field
    assert shared.spans == plain.spans


def test_shared_prompt_blocks_stay_within_their_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("miles.training.packing.SHARED_BLOCK_TOKENS", 8)
    samples = [_sample([1, 2, 3], [4, 5]) for _ in range(4)]  # 5 positions alone, 2 + 3 per sample in a block
    (mb,) = pack_micro_batches(samples, pad_id=0, share_prompts=True)
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 3, 4, 5], [1, 2, 3, 4, 5, 3, 4, 5]]
    assert sorted(s.sample for s in mb.spans) == [0, 1, 2, 3]
