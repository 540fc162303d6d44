"""save_peft_adapter / load_peft_adapter against peft itself: what we write, peft loads to the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from miles.config import LoraConfig
from miles.engines import adapter_files
from miles.engines.adapter_files import load_peft_adapter, save_peft_adapter

LORA = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])


def tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def trained() -> tuple[dict[str, torch.Tensor], PeftModel, dict[str, torch.Tensor]]:
    """A peft LoRA model with non-zero lora_B (so the adapter changes logits), its adapter and its base weights."""
    torch.manual_seed(0)
    base = tiny_llama()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    peft_cfg = PeftLoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=LORA.target_modules, lora_dropout=0.0)
    model = get_peft_model(base, peft_cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param))
    return get_peft_model_state_dict(model), model, base_state


def fresh_base(base_state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    base = tiny_llama()
    base.load_state_dict(base_state)
    return base


def test_peft_loads_what_we_save_to_identical_logits(trained, tmp_path: Path) -> None:
    adapter, model, base_state = trained
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter) and len(adapter) == 8
    out = save_peft_adapter(adapter, LORA, tmp_path / "adapters" / "v1", base_model="tiny/llama")
    assert out == tmp_path / "adapters" / "v1"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert [p.name for p in out.parent.iterdir()] == ["v1"]  # no temporary directory left behind

    config = json.loads((out / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "target_modules")} == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["q_proj", "v_proj"],
    }
    assert config["lora_dropout"] == 0.0 and config["bias"] == "none" and config["fan_in_fan_out"] is False
    assert config["inference_mode"] is True and config["base_model_name_or_path"] == "tiny/llama"

    loaded = PeftModel.from_pretrained(fresh_base(base_state), out).eval()
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        plain = fresh_base(base_state)(input_ids=ids).logits
    assert torch.equal(got, want)
    assert not torch.allclose(plain, want)  # the adapter really is in play


def test_files_match_peft_save_pretrained_and_round_trip(trained, tmp_path: Path) -> None:
    adapter, model, _ = trained
    model.save_pretrained(tmp_path / "peft")
    ours = save_peft_adapter(adapter, LORA, tmp_path / "ours")
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    tensors, config = load_peft_adapter(ours)
    assert sorted(tensors) == sorted(theirs) == sorted(adapter)
    assert all(torch.equal(tensors[k], theirs[k]) and torch.equal(tensors[k], adapter[k]) for k in adapter)
    assert config["r"] == 2 and config["peft_type"] == "LORA"


def test_save_replaces_an_existing_adapter_atomically(trained, tmp_path: Path) -> None:
    adapter, _, _ = trained
    target = tmp_path / "v1"
    save_peft_adapter(adapter, LORA, target)
    doubled = {k: v * 2 for k, v in adapter.items()}
    save_peft_adapter(doubled, LORA, str(target))
    tensors, _ = load_peft_adapter(target)
    assert all(torch.equal(tensors[k], doubled[k]) for k in adapter)
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]


def test_failed_write_leaves_the_previous_adapter_and_no_debris(trained, tmp_path: Path, monkeypatch) -> None:
    adapter, _, _ = trained
    target = tmp_path / "v1"
    save_peft_adapter(adapter, LORA, target)

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_peft_adapter({k: v * 3 for k, v in adapter.items()}, LORA, target)
    with pytest.raises(OSError, match="disk full"):
        save_peft_adapter(adapter, LORA, tmp_path / "v2")
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]
    tensors, _ = load_peft_adapter(target)
    assert all(torch.equal(tensors[k], adapter[k]) for k in adapter)


def test_bfloat16_and_non_contiguous_tensors_are_saved(tmp_path: Path) -> None:
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    adapter = {
        key.format("A"): torch.randn(2, 8, dtype=torch.bfloat16),
        key.format("B"): torch.randn(2, 8, dtype=torch.bfloat16).t(),  # (8, 2), a non-contiguous view
    }
    tensors, _ = load_peft_adapter(save_peft_adapter(adapter, LORA, tmp_path / "a"))
    assert tensors[key.format("B")].dtype == torch.bfloat16 and torch.equal(
        tensors[key.format("B")], adapter[key.format("B")]
    )


def test_fractional_alpha_is_kept() -> None:
    assert adapter_files.adapter_config(LoraConfig(rank=8, alpha=12.5, target_modules=["q_proj"]))["lora_alpha"] == 12.5


KEY_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
KEY_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    ("adapter", "match"),
    [
        ({}, "empty LoRA adapter"),
        ({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, "not peft LoRA keys.*get_peft_model_state_dict"),
        (
            {KEY_A.replace("lora_A.weight", "lora_A.default.weight"): torch.zeros(2, 32)},
            "not peft LoRA keys",
        ),
        ({KEY_A.removeprefix("base_model.model."): torch.zeros(2, 32)}, "not peft LoRA keys"),
        ({KEY_A: torch.zeros(2, 32)}, "no lora_B tensor"),
        (
            {
                KEY_A.replace("q_proj", "o_proj"): torch.zeros(2, 32),
                KEY_B.replace("q_proj", "o_proj"): torch.zeros(32, 2),
            },
            "not in target_modules",
        ),
        ({KEY_A: torch.zeros(4, 32), KEY_B: torch.zeros(32, 4)}, "r = 2"),
    ],
)
def test_invalid_adapters_raise_value_error(adapter, match: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        save_peft_adapter(adapter, LORA, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_load_rejects_a_directory_that_is_not_an_adapter(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        load_peft_adapter(tmp_path)


def test_failed_rename_puts_the_previous_adapter_back(trained, tmp_path: Path, monkeypatch) -> None:
    adapter, _, _ = trained
    target = tmp_path / "v1"
    save_peft_adapter(adapter, LORA, target)
    real_replace = adapter_files.os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".v1.tmp-"):
            raise OSError("rename failed")
        real_replace(src, dst)

    monkeypatch.setattr(adapter_files.os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"):
        save_peft_adapter({k: v * 3 for k, v in adapter.items()}, LORA, target)
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]
    tensors, _ = load_peft_adapter(target)
    assert all(torch.equal(tensors[k], adapter[k]) for k in adapter)
