"""Weight sync on each family's real tensor names and layouts (tiny twins, CPU): delta, LoRA, quantized rollout.

These drive the sync code (miles/sync) with the twins' state dicts: delta coding of fused 3-D experts, LoRA
on each family's targets, and rollout quantization under each family's rule and native format.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from miles.config import LoraConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.families import family_names, get_family
from miles.models.families.build import build_tiny_twin
from miles.models.families.rules import lora_targets, quantizable
from miles.models.loading import load_policy
from miles.sync.delta import apply_state_delta, encode_state_delta
from miles.sync.lora import AdapterApplier, add_adapters, lora_scale, split_peft_state
from miles.sync.precision import SCALE_SUFFIX, from_rollout_state, is_quantizable, to_rollout_state
from miles.sync.stream_export import TensorSpec, rollout_specs

FAMILIES = family_names()


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("twins")
    return {name: build_tiny_twin(name, root) for name in FAMILIES}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor: equality of these is bit-exactness (-0.0 differs from 0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _one_step(model: torch.nn.Module, tokenizer, lr: float) -> None:
    ids = torch.tensor([tokenizer.encode("12+7=19 ls -la", add_special_tokens=False)])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_delta_round_trips_and_loads_into_the_engine(name: str, twins: dict[str, Path]) -> None:
    """One Adam step, delta-coded in BF16 (fused 3-D experts included), is bit-exact and fits the engine."""
    model, tokenizer = load_policy(twins[name])
    before = to_rollout_state(model.state_dict(), "bfloat16")
    _one_step(model, tokenizer, lr=1e-3)
    after = to_rollout_state(model.state_dict(), "bfloat16")
    rebuilt = apply_state_delta(before, encode_state_delta(before, after, 0, 1), 0)
    assert set(rebuilt) == set(after)
    assert all(torch.equal(_bits(rebuilt[k]), _bits(after[k])) for k in after)
    experts = [k for k in after if after[k].dim() == 3 and ".experts." in k]
    assert experts and any(not torch.equal(before[k], after[k]) for k in experts)
    engine_model, _ = load_policy(twins[name])
    engine = TorchEngine(engine_model, tokenizer.pad_token_id)
    engine.load_weights(rebuilt, version=1)
    assert engine.version == 1


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_sync_merges_the_family_targets_like_peft(name: str, twins: dict[str, Path]) -> None:
    """Adapters on the family's targets (MLA projections included) travel under peft names and merge exactly."""
    family = get_family(name)
    cfg = LoraConfig(rank=2, alpha=4, target_modules=lora_targets(family)["target_modules"])
    model, tokenizer = load_policy(twins[name])
    wrapped = add_adapters(model, cfg)
    _one_step(wrapped, tokenizer, lr=1e-2)  # B moves off zero: the adapter is no longer a no-op
    adapter, base = split_peft_state(wrapped.state_dict())
    assert {k.split(".lora_")[0].split(".")[-1] for k in adapter} == set(family.lora.modules)
    engine_model, _ = load_policy(twins[name])
    engine = TorchEngine(engine_model, tokenizer.pad_token_id)
    merged = AdapterApplier(lambda: engine.model.state_dict(), lora_scale(cfg)).merged(adapter)
    reference = wrapped.merge_and_unload().state_dict()
    for key, value in merged.items():
        assert torch.allclose(value, reference[key].float(), atol=1e-6), key
    engine.load_weights(merged, version=1, complete=False)


@pytest.mark.parametrize("name", FAMILIES)
def test_rollout_quantization_follows_the_family_rule(name: str, twins: dict[str, Path]) -> None:
    """What sync quantizes is what the family's rule says: fused experts in, routers and gates out; the
    generic rule (no family) is unchanged: 2-D linear weights only."""
    model, _ = load_policy(twins[name])
    family = get_family(name)
    state = model.state_dict()
    ruled = {k for k, t in state.items() if quantizable(k, t, family) is not None}
    assert {k for k, t in state.items() if is_quantizable(k, t, "fp8_e4m3", family)} == ruled
    assert {k for k, t in state.items() if is_quantizable(k, t, "fp8_e4m3", name)} == ruled  # by name too
    if family.moe is not None and family.quant.experts is not None:
        assert any(state[k].dim() == 3 for k in ruled)  # fused 3-D experts quantize
    assert not any(re.search(p, k) for k in ruled for p in family.quant.exclude)
    generic = {k for k, t in state.items() if is_quantizable(k, t, "fp8_e4m3")}
    assert all(state[k].dim() == 2 for k in generic)


@pytest.mark.parametrize("precision", ["fp8_e4m3", "fp4_e2m1"])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_rollout_state_round_trips_and_streams_the_same(
    name: str, precision: str, twins: dict[str, Path]
) -> None:
    """Every quantized tensor comes back in the model's own shape, close to the master weights; the streamed
    export's plan (shapes known up front) matches the whole-state conversion tensor for tensor."""
    model, _ = load_policy(twins[name])
    state = model.state_dict()
    published = to_rollout_state(state, precision, name)
    back = from_rollout_state(published, torch.float32)
    assert set(back) == set(state)
    quantized = [k for k in state if k + SCALE_SUFFIX in published]
    assert quantized
    tolerance = 1 / 16 if precision == "fp8_e4m3" else 1 / 2  # worst relative step of e4m3 / e2m1 near amax
    for k in quantized:
        assert back[k].shape == state[k].shape, k
        assert not torch.equal(back[k], state[k]), k  # really quantized
        assert float((back[k] - state[k]).abs().max()) <= tolerance * float(state[k].abs().max()), k
    plan = rollout_specs([TensorSpec.of(k, t) for k, t in state.items()], precision, name)
    assert [(s.name, s.dtype, s.shape) for s in plan] == sorted(
        (k, t.dtype, tuple(t.shape)) for k, t in published.items()
    )


def test_deepseek_fp8_is_block_scaled_128() -> None:
    """DeepSeek-V3.2's released format: e4m3 codes with one float32 scale per 128x128 block, experts too."""
    family = get_family("deepseek_v32")
    state = {
        "model.layers.1.self_attn.q_b_proj.weight": torch.randn(300, 200),
        "model.layers.1.mlp.experts.gate_up_proj": torch.randn(4, 260, 64),
        "model.layers.1.mlp.gate.weight": torch.randn(4, 64),
    }
    out = to_rollout_state(state, "fp8_e4m3", family)
    assert out["model.layers.1.self_attn.q_b_proj.weight.qscale"].shape == (3, 2)
    assert out["model.layers.1.mlp.experts.gate_up_proj.qscale"].shape == (4, 3, 1)
    assert out["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # the router stays bf16
    assert to_rollout_state(state, "fp8_e4m3")["model.layers.1.self_attn.q_b_proj.weight.qscale"].shape == ()


def test_gpt_oss_fp4_is_mxfp4_along_the_input_axis() -> None:
    """GPT-OSS's released expert format: e2m1 codes, one e8m0 scale per 32 input features; its experts are
    (E, in, out), so the blocks run along axis 1. Attention, router and sinks stay bf16."""
    family = get_family("gpt_oss")
    state = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 64, 192),  # (E, in=hidden, out=2*inter)
        "model.layers.0.mlp.experts.down_proj": torch.randn(4, 96, 64),  # (E, in=inter, out=hidden)
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
        "model.layers.0.self_attn.sinks": torch.randn(4),
    }
    out = to_rollout_state(state, "fp4_e2m1", family)
    assert out["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 96)
    assert out["model.layers.0.mlp.experts.gate_up_proj.qscale"].shape == (4, 2, 192)
    assert out["model.layers.0.mlp.experts.down_proj.qscale"].shape == (4, 3, 64)
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert out["model.layers.0.self_attn.sinks"].dtype == torch.bfloat16
    back = from_rollout_state(out, torch.float32)
    assert back["model.layers.0.mlp.experts.down_proj"].shape == (4, 96, 64)


@pytest.mark.parametrize("name", FAMILIES)
def test_fp8_rollout_state_round_trips_with_the_generic_rule(name: str, twins: dict[str, Path]) -> None:
    """Without a family (a family checkpoint loaded as ``type: pretrained``) the generic rule still runs."""
    model, _ = load_policy(twins[name])
    state = model.state_dict()
    back = from_rollout_state(to_rollout_state(state, "fp8_e4m3"), torch.float32)
    assert set(back) == set(state)
