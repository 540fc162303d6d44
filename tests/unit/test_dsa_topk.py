"""The DSA indexer's top-k tie-break (miles/models/dsa_topk.py): ties go to the earliest key, whatever the shape.

The end-to-end consequence (the engine's cached decoding of DeepSeek-V3.2 and GLM-5.2 equals teacher forcing) is
checked in ``test_engine_architectures.py``; these are the parts, in milliseconds.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM

from miles.models.dsa_topk import StableTopkIndexer, stabilize_dsa_topk, stable_topk
from miles.models.loading import load_policy

K = 8


def tied_scores(seed: int, queries: int = 42) -> torch.Tensor:
    """Causal index scores (1, S, S) as the indexer makes them: most keys exactly 0, the future -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, queries, queries, generator=g)
    x = torch.where(torch.rand(1, queries, queries, generator=g) < 0.8, torch.zeros(()), x)
    return x.masked_fill(torch.ones(queries, queries, dtype=torch.bool).triu(1), float("-inf"))


def test_ties_go_to_the_lowest_index_and_values_match_torch() -> None:
    scores = torch.tensor([[0.0, 2.0, 0.0, -1.0, 0.0, 3.0]])
    top = stable_topk(scores, 4)
    assert top.indices.tolist() == [[5, 1, 0, 2]]
    assert torch.equal(top.values, scores.topk(4).values)
    assert stable_topk(scores, 2, largest=False).indices.tolist() == [[3, 0]]
    distinct = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0))  # no ties: torch's answer
    assert torch.equal(stable_topk(distinct, K).indices, distinct.topk(K).indices)


@pytest.mark.parametrize("seed", range(4))
def test_a_cached_row_selects_what_the_full_sequence_selects(seed: int) -> None:
    """Query t decoding against its cache sees t + 1 keys; in a full forward it sees a row of S with the future
    at -inf. The selected keys must not depend on which. ``torch.topk``'s do: on torch 2.13 its sets differ at
    some query for every one of these seeds."""
    scores = tied_scores(seed)
    for t in range(K, scores.shape[1]):
        full = stable_topk(scores, K).indices[0, t]
        cached = stable_topk(scores[:, t : t + 1, : t + 1], K).indices[0, 0]
        assert full.tolist() == cached.tolist()


def tiny_dsa() -> torch.nn.Module:
    config = transformers.GlmMoeDsaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_stabilize_switches_every_indexer_once_and_survives_deepcopy() -> None:
    model = tiny_dsa()
    ids = torch.tensor([[1, *range(3, 30)]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    keys = list(model.state_dict())
    assert stabilize_dsa_topk(model) == 2
    assert stabilize_dsa_topk(model) == 2  # idempotent
    indexers = [m for m in model.modules() if isinstance(m, StableTopkIndexer)]
    assert len(indexers) == 2 and all(type(m).__name__ == "StableTopkGlmMoeDsaIndexer" for m in indexers)
    assert list(model.state_dict()) == keys  # same parameters, same names: checkpoints and sync unaffected
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
        clone = copy.deepcopy(model)
        reference = clone(input_ids=ids).logits
        for p in model.parameters():  # the copy must compute with its own weights, not the original's
            p.mul_(0.5)
        assert torch.equal(clone(input_ids=ids).logits, reference)
    assert before.shape == reference.shape


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    return AutoModelForCausalLM.from_config(config)


def test_models_without_dsa_are_untouched() -> None:
    model = tiny_llama()
    classes = [type(m) for m in model.modules()]
    assert stabilize_dsa_topk(model) == 0
    assert [type(m) for m in model.modules()] == classes


def test_a_dsa_config_without_a_known_indexer_class_is_refused() -> None:
    model = tiny_llama()
    model.config.index_topk = 4  # as if transformers had renamed its indexer class
    with pytest.raises(RuntimeError, match="index_topk.*dsa_topk.py"):
        stabilize_dsa_topk(model)


def test_load_policy_stabilizes_the_indexers(tmp_path: Path) -> None:
    tiny_dsa().save_pretrained(tmp_path)
    vocab = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=vocab).save_pretrained(tmp_path)
    model, _ = load_policy(tmp_path)
    assert sum(isinstance(m, StableTopkIndexer) for m in model.modules()) == 2
