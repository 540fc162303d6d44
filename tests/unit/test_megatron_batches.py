"""Packed Miles rows as megatron inputs (mask and THD layouts, CP split) and vocab-parallel log-probs.

The THD layout itself needs TransformerEngine to run a model; here its index bookkeeping is checked:
every trained position is computed exactly once across the CP ranks and lands back where it came from.
"""

from __future__ import annotations

import pytest
import torch

from miles.algo.logprobs import token_entropy, token_logprobs
from miles.backends.megatron.batches import block_causal_mask, cp_token_index, mask_layout, segment_ids, thd_plan
from miles.backends.megatron.logprobs import vocab_parallel_logprobs
from tests.unit.test_megatron_support import pack_rows


def _batch():
    return pack_rows([[[5, 6, 7], [8, 9, 10, 11]], [[3, 4, 5, 6, 7]]], width=9)


def test_block_causal_mask_keeps_sequences_apart() -> None:
    mb = _batch()
    assert segment_ids(mb.position_ids)[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 3]
    mask = block_causal_mask(mb.position_ids)[0, 0]  # (L, L), True = masked
    allowed = ~mask
    assert allowed[2, :3].all() and not allowed[2, 3:].any()
    assert allowed[4, 3:5].all() and not allowed[4, :3].any() and not allowed[4, 5:].any()
    assert allowed.diagonal().all()


def test_mask_layout_pads_to_the_sequence_parallel_multiple() -> None:
    mb = _batch()
    inputs = mask_layout(mb, multiple=4, pad_token_id=0)
    assert inputs.input_ids.shape == (2, 12) and inputs.attention_mask.shape == (2, 1, 12, 12)
    assert torch.equal(inputs.scatter(inputs.targets.float()), mb.targets.float())


@pytest.mark.parametrize("cp", [1, 2])
def test_thd_plan_covers_every_predicting_token_once(cp: int) -> None:
    mb = _batch()
    plan = thd_plan(mb, cp=cp, tp=2)
    lengths = (plan.cu_seqlens[1:] - plan.cu_seqlens[:-1]).tolist()
    assert all(n % (2 * cp) == 0 for n in lengths) and sum(lengths) % (2 * cp * 2) == 0
    picked = torch.cat([plan.source[cp_token_index(plan, cp, k)] for k in range(cp)])
    real = picked[picked >= 0]
    assert len(real) == len(set(real.tolist()))  # no token twice
    flat_needed = (mb.seq_index.flatten() >= 0).nonzero().flatten()
    assert set(flat_needed.tolist()) <= set(real.tolist())  # every token with a target is computed
    assert sum(cp_token_index(plan, cp, k).numel() for k in range(cp)) == plan.source.numel()


@pytest.mark.parametrize("cp", [1, 2])
def test_thd_scatter_puts_values_back(cp: int) -> None:
    pytest.importorskip("megatron.core")
    from miles.backends.megatron.batches import thd_layout

    mb = _batch()
    per_rank = [thd_layout(mb, cp=cp, cp_rank=k, tp=1) for k in range(cp)]
    gathered = torch.stack([r.targets.float() for r in per_rank])  # what the CP all-gather returns

    def gather(x: torch.Tensor) -> torch.Tensor:
        return gathered

    layout = thd_layout(mb, cp=cp, cp_rank=0, tp=1, gather_cp=gather if cp > 1 else None)
    back = layout.scatter(per_rank[0].targets.float())
    keep = mb.seq_index >= 0
    assert torch.equal(back[keep], mb.targets[keep].float())
    assert layout.packed_seq_params.qkv_format == "thd"


def _padded_logits(vocab: int, padded: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, padded, generator=g) * 3
    logits[..., vocab:] = 5.0  # padding columns must not count
    return logits.requires_grad_(True)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_logprobs_and_entropy_match_the_shared_functions(chunk: int) -> None:
    vocab, padded, temperature = 13, 16, 0.7
    logits = _padded_logits(vocab, padded)
    targets = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(1))
    logp, ent = vocab_parallel_logprobs(
        logits, targets, vocab_size=vocab, temperature=temperature, entropy=True, chunk_tokens=chunk
    )
    ref_logits = logits[..., :vocab]
    torch.testing.assert_close(logp, token_logprobs(ref_logits, targets, temperature))
    torch.testing.assert_close(ent, token_entropy(ref_logits, temperature))
    (logp.sum() + ent.sum()).backward()
    grad = logits.grad.clone()
    logits.grad = None
    (token_logprobs(ref_logits, targets, temperature).sum() + token_entropy(ref_logits, temperature).sum()).backward()
    torch.testing.assert_close(grad, logits.grad)
    assert torch.all(grad[..., vocab:] == 0)


def test_logprobs_reject_zero_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long), vocab_size=4, temperature=0)
