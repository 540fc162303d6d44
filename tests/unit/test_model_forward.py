"""The engine's lean Llama forward gives the HF forward's logits and cache, and is used only where it applies."""

from __future__ import annotations

import asyncio

import pytest
import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from miles.config import TorchEngineConfig
from miles.engines.base import SamplingParams
from miles.engines.model_forward import hf_forward, lean_forward_for, select_forward
from miles.engines.torch_engine import TorchEngine

CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    max_position_embeddings=128,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def llama(dtype: torch.dtype = torch.float32, **overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**CONFIG, **overrides})).to(dtype).eval()


def padded_prefill() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of 7, 4 and 1 tokens: ids, mask (B, P) and per-row positions."""
    lengths, width = [7, 4, 1], 7
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.long)
    gen = torch.Generator().manual_seed(1)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, 64, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def run_both(
    model: LlamaForCausalLM, steps: int
) -> list[tuple[torch.Tensor, torch.Tensor, DynamicCache, DynamicCache]]:
    """Prefill then ``steps`` decode steps through both forwards, feeding both the HF forward's greedy token."""
    lean, _ = lean_forward_for(model)
    assert lean is not None
    hf = hf_forward(model)
    ids, mask, pos = padded_prefill()
    hf_cache, lean_cache = DynamicCache(), DynamicCache()
    out = []
    with torch.inference_mode():
        want, got = hf(ids, mask, pos, hf_cache), lean(ids, mask, pos, lean_cache)
        out.append((want, got, hf_cache, lean_cache))
        pos = mask.sum(-1, keepdim=True)  # (B, 1)
        for _ in range(steps):
            token = want.argmax(-1, keepdim=True)  # (B, 1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            want, got = hf(token, mask, pos, hf_cache), lean(token, mask, pos, lean_cache)
            out.append((want, got, hf_cache, lean_cache))
            pos = pos + 1
    return out


def test_float32_logits_and_cache_equal_the_hf_forward_with_padded_rows() -> None:
    model = llama()
    ids, mask, _ = padded_prefill()
    for want, got, hf_cache, lean_cache in run_both(model, steps=3):
        assert got.shape == want.shape == (3, CONFIG["vocab_size"])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    real = torch.cat([mask, torch.ones((3, 3), dtype=torch.long)], dim=1).bool()  # (B, T): non-padding columns
    for hf_layer, lean_layer in zip(hf_cache.layers, lean_cache.layers, strict=True):
        for a, b in ((hf_layer.keys, lean_layer.keys), (hf_layer.values, lean_layer.values)):
            keep = real[:, None, :, None].expand_as(a)
            torch.testing.assert_close(b[keep], a[keep], rtol=0, atol=1e-5)


def test_an_unpadded_prefill_takes_the_causal_kernel_and_equals_the_hf_forward() -> None:
    model = llama()
    lean, _ = lean_forward_for(model)
    assert lean is not None
    ids = torch.randint(3, 64, (4, 9), generator=torch.Generator().manual_seed(2))
    mask, pos = torch.ones_like(ids), torch.arange(9).expand(4, 9)
    hf_cache, lean_cache = DynamicCache(), DynamicCache()
    with torch.inference_mode():
        torch.testing.assert_close(lean(ids, mask, pos, lean_cache), hf_forward(model)(ids, mask, pos, hf_cache))
    for hf_layer, lean_layer in zip(hf_cache.layers, lean_cache.layers, strict=True):
        torch.testing.assert_close(lean_layer.keys, hf_layer.keys)
        torch.testing.assert_close(lean_layer.values, hf_layer.values)


def test_bfloat16_follows_the_hf_forward() -> None:
    """Reduced precision runs HF's own norm module (the fused op rounds differently): close, to bf16 noise."""
    for want, got, *_ in run_both(llama(torch.bfloat16), steps=2):
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.05)


def test_rope_scaling_is_the_models_own() -> None:
    model = llama(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    for want, got, *_ in run_both(model, steps=2):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (lambda: llama(attention_bias=True), "biased"),
        (lambda: llama(mlp_bias=True), "biased"),
        (lambda: llama(hidden_act="gelu"), "hidden_act"),
        (
            lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG, head_dim=8)),
            "not LlamaForCausalLM",
        ),
    ],
)
def test_other_architectures_keep_the_hf_forward(model: object, why: str) -> None:
    built = model()  # type: ignore[operator]
    lean, reason = lean_forward_for(built)
    assert lean is None and why in reason
    _, kind = select_forward(built, "auto")
    assert kind.startswith("hf") and why in kind


def test_a_wrapped_projection_keeps_the_hf_forward() -> None:
    """An adapter or quantized layer replaces a Linear with a subclass: its weight alone is not the layer."""

    class Adapted(torch.nn.Linear):
        pass

    model = llama()
    old = model.model.layers[1].mlp.up_proj
    model.model.layers[1].mlp.up_proj = Adapted(old.in_features, old.out_features, bias=False)
    lean, reason = lean_forward_for(model)
    assert lean is None and "layer 1" in reason


def test_forward_hf_is_honoured() -> None:
    _, kind = select_forward(llama(), "hf")
    assert kind == "hf (rollout.engine.forward: hf)"


async def test_the_engine_samples_the_same_tokens_with_either_forward() -> None:
    """Seeded sampling at T = 1 through continuous batching: same tokens, same behaviour log-probs."""
    prompts = [[1, 5, 9, 11], [1, 7], [1, 5, 9, 11], [1, 20, 21, 22, 23, 24], [1, 3]]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    results = []
    for forward in ("auto", "hf"):
        engine = TorchEngine(llama(), pad_token_id=0, cfg=TorchEngineConfig(forward=forward), seed=5)
        async with engine:
            results.append(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))
    lean, hf = results
    for a, b in zip(lean, hf, strict=True):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
