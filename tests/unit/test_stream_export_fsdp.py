"""iter_full_params / export_specs on unsharded models and a one-rank FSDP2 mesh: names, ties, LoRA, bits."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from miles.backends.distributed import distributed
from miles.backends.fsdp_export import export_specs, iter_full_params
from miles.config import LoraConfig
from miles.ports import free_port
from miles.sync.checksum import digest
from miles.sync.lora import add_adapters, lora_scale, merged_state, split_peft_state
from miles.sync.payload import deserialize_state
from miles.sync.precision import state_digest, to_rollout_state
from miles.sync.stream_export import PayloadLayout, TensorSpec, encode_payload

LORA = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])


def tiny(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg)


def trained_lora() -> torch.nn.Module:
    model = add_adapters(tiny(), LORA)
    with torch.no_grad():  # B starts at 0: give the adapter a visible effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


def test_untied_model_exports_its_state_dict_sorted() -> None:
    model = tiny()
    expected = model.state_dict()
    got = list(iter_full_params(model))
    assert [n for n, _ in got] == sorted(expected)
    for name, tensor in got:
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert torch.equal(tensor, expected[name])
    assert export_specs(model) == [TensorSpec.of(n, t) for n, t in got]


def test_tied_weights_export_once_like_save_pretrained() -> None:
    model = tiny(tied=True)
    names = [n for n, _ in iter_full_params(model)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == len(model.state_dict()) - 1


def test_lora_adapter_only_and_merged() -> None:
    model = trained_lora()
    adapter, _ = split_peft_state(model.state_dict())
    got = dict(iter_full_params(model, adapter_only=True))
    assert list(got) == sorted(adapter)
    assert all(torch.equal(got[k], adapter[k]) for k in adapter)

    merged = merged_state(model.state_dict(), lora_scale(LORA))
    full = dict(iter_full_params(model, lora_scale=lora_scale(LORA)))
    assert list(full) == sorted(merged)
    for name, value in merged.items():
        assert torch.equal(full[name], value), name
    assert [s.name for s in export_specs(model, lora_scale=2.0)] == sorted(merged)

    with pytest.raises(ValueError, match="lora_scale"):
        list(iter_full_params(model))
    with pytest.raises(ValueError, match="peft"):
        export_specs(tiny(), adapter_only=True)


@pytest.mark.parametrize("precision", ["bfloat16", "fp8_e4m3", "fp4_e2m1"])
def test_streamed_export_of_a_model_matches_the_whole_state_path(precision: str) -> None:
    model = tiny()
    layout = PayloadLayout.plan(export_specs(model), precision, 3)
    pieces: list[bytes] = []
    summary = encode_payload(layout, iter_full_params(model), lambda p: pieces.append(bytes(p)))
    payload = b"".join(pieces)
    expected = to_rollout_state(model.state_dict(), precision)
    assert summary.state_digest == state_digest(expected) == state_digest(deserialize_state(payload))
    assert summary.digest == digest(payload)


def test_one_rank_process_group_gathers_dtensors() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny(tied=True)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with distributed(0, 1, "127.0.0.1", free_port(), timeout_s=60):
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        got = dict(iter_full_params(model, dst=0))
        specs = export_specs(model)
    assert list(got) == [s.name for s in specs] == sorted(set(expected) - {"lm_head.weight"})
    assert all(torch.equal(got[k], expected[k]) for k in got)
