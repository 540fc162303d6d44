"""HF config -> megatron-core config translation, backend settings, and the start-up availability check.

Translation is pure (no megatron-core needed); the last tests build the real ``TransformerConfig`` objects
when megatron-core is installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from miles.backends.megatron import megatron_unavailable_reason
from miles.backends.megatron.config import UnsupportedModelError, moe_kwargs, padded_vocab_size, translate
from miles.backends.megatron.settings import MegatronSettings
from miles.config import MegatronBackendConfig, load_config


def _has_megatron_core() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


NEEDS_MEGATRON = pytest.mark.skipif(not _has_megatron_core(), reason="needs megatron-core installed")

LLAMA = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}


def test_llama_translation() -> None:
    args = translate(LLAMA)
    assert args.family == "llama" and not args.mla and args.num_experts is None
    tr = args.transformer
    assert (tr["num_layers"], tr["hidden_size"], tr["num_attention_heads"], tr["num_query_groups"]) == (2, 64, 8, 2)
    assert (tr["ffn_hidden_size"], tr["kv_channels"], tr["layernorm_epsilon"]) == (128, 8, 1e-5)
    assert tr["gated_linear_unit"] and tr["normalization"] == "RMSNorm" and not tr["add_qkv_bias"]
    assert tr["hidden_dropout"] == tr["attention_dropout"] == 0.0
    assert args.gpt == {
        "max_sequence_length": 256,
        "share_embeddings_and_output_weights": True,
        "position_embedding_type": "rope",
        "rotary_base": 500000,
        "rotary_percent": 1.0,
    }


def test_qwen_variants() -> None:
    qwen2 = translate({**LLAMA, "model_type": "qwen2"})
    assert qwen2.transformer["add_qkv_bias"] and not qwen2.transformer["qk_layernorm"]
    qwen3 = translate({**LLAMA, "model_type": "qwen3", "head_dim": 32, "attention_bias": False})
    assert qwen3.transformer["qk_layernorm"] and qwen3.transformer["kv_channels"] == 32


@pytest.mark.parametrize(
    ("rope", "expected", "attrs"),
    [
        ({"rope_type": "linear", "factor": 4.0}, {"seq_len_interpolation_factor": 4.0}, {}),
        ({"rope_type": "llama3", "factor": 8.0}, {"rope_scaling": True, "rope_scaling_factor": 8.0}, {}),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
            {"position_embedding_type": "yarn"},
            {"yarn_rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 32},
        ),
    ],
)
def test_rope_variants(rope: dict, expected: dict, attrs: dict) -> None:
    args = translate({**LLAMA, "rope_parameters": {"rope_theta": 10000.0, **rope}})
    for key, value in expected.items():
        assert args.gpt[key] == value
    for key, value in attrs.items():
        assert args.config_attrs[key] == value


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}}, "low_freq_factor"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic'"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
    ],
)
def test_unsupported_configs_name_the_field(change: dict, words: str) -> None:
    with pytest.raises(UnsupportedModelError, match=words):
        translate({**LLAMA, **change})


def test_qwen3_moe_translation() -> None:
    hf = {**LLAMA, "model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}
    hf.update(moe_intermediate_size=32, mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True)
    args = translate(hf)
    tr = args.transformer
    assert (tr["num_moe_experts"], tr["moe_router_topk"], tr["moe_ffn_hidden_size"]) == (8, 2, 32)
    assert tr["moe_layer_freq"] == [0, 1, 1, 1] and args.moe_layers == [1, 2, 3]
    assert tr["moe_router_pre_softmax"] is False  # top-k then softmax == renormalised top-k
    assert translate({**hf, "norm_topk_prob": False}).transformer["moe_router_pre_softmax"] is True
    assert translate({**hf, "decoder_sparse_step": 2, "mlp_only_layers": []}).transformer["moe_layer_freq"] == [
        0,
        1,
        0,
        1,
    ]
    renamed = {k: v for k, v in hf.items() if k != "num_experts"} | {"num_local_experts": 8}  # transformers 5
    assert translate(renamed).num_experts == 8


DEEPSEEK = {
    **LLAMA,
    "model_type": "deepseek_v3",
    "num_hidden_layers": 3,
    "num_key_value_heads": 8,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 2,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}


def test_deepseek_translation() -> None:
    args = translate(DEEPSEEK)
    tr = args.transformer
    assert args.family == "deepseek" and args.mla and "kv_channels" not in tr
    assert (tr["q_lora_rank"], tr["kv_lora_rank"], tr["qk_head_dim"], tr["qk_pos_emb_head_dim"], tr["v_head_dim"]) == (
        16,
        8,
        8,
        4,
        8,
    )
    assert tr["rope_type"] == "yarn" and tr["rotary_scaling_factor"] == 40.0 and tr["mscale_all_dim"] == 1.0
    assert tr["moe_layer_freq"] == [0, 1, 1] and tr["moe_shared_expert_intermediate_size"] == 32
    assert tr["moe_router_score_function"] == "sigmoid" and tr["moe_router_enable_expert_bias"]
    assert (tr["moe_router_num_groups"], tr["moe_router_group_topk"], tr["moe_router_topk_scaling_factor"]) == (
        4,
        2,
        2.5,
    )
    assert args.hf["rope_interleave"] is True
    assert translate({**DEEPSEEK, "q_lora_rank": None}).transformer["q_lora_rank"] is None


def test_deepseek_routing_megatron_cannot_reproduce() -> None:
    with pytest.raises(UnsupportedModelError, match="topk_group"):
        translate({**DEEPSEEK, "topk_group": 1})  # HF scores groups by top-2; megatron by top-(4 // 1)
    with pytest.raises(UnsupportedModelError, match="norm_topk_prob"):
        translate({**DEEPSEEK, "norm_topk_prob": False})


def test_settings_from_todays_backend_config_and_layout_checks() -> None:
    settings = MegatronSettings.from_backend_config(MegatronBackendConfig(tensor_parallel=2, pipeline_parallel=2))
    assert (settings.tensor_parallel, settings.pipeline_parallel, settings.context_parallel) == (2, 2, 1)
    assert settings.data_parallel_size(8) == 2 and settings.uses_sequence_parallel
    with pytest.raises(ValueError, match="not a multiple"):
        settings.data_parallel_size(6)
    with pytest.raises(ValueError, match="expert_parallel 4 must divide"):
        MegatronSettings(expert_parallel=4).data_parallel_size(2)
    with pytest.raises(ValueError, match="virtual_pipeline_parallel"):
        MegatronSettings(virtual_pipeline_parallel=2)
    assert padded_vocab_size(61, 4) == 64 and padded_vocab_size(64, 4) == 64


def test_moe_settings_reach_the_megatron_config() -> None:
    hf = {**LLAMA, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    args = translate(hf)
    kw = moe_kwargs(args, MegatronSettings(moe_aux_loss_coef=1e-3, moe_capacity_factor=1.25))
    assert kw["moe_aux_loss_coeff"] == 1e-3 and kw["moe_router_load_balancing_type"] == "aux_loss"
    assert kw["moe_expert_capacity_factor"] == 1.25 and kw["moe_token_drop_policy"] == "probs"
    assert moe_kwargs(args, MegatronSettings())["moe_router_load_balancing_type"] == "none"
    assert moe_kwargs(translate(LLAMA), MegatronSettings()) == {}


# --------------------------------------------------------------------------- start-up check


def _megatron_cfg(*sets: str):
    return load_config(None, ["trainer.backend.type=megatron", *sets])


def test_unavailable_reason_is_none_for_fsdp() -> None:
    assert megatron_unavailable_reason(load_config(None, [])) is None


def test_unavailable_without_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("megatron") else real(name, *a)
    )
    reason = megatron_unavailable_reason(_megatron_cfg())
    assert reason == "trainer.backend.type=megatron needs megatron-core: pip install 'miles[megatron]'"


@NEEDS_MEGATRON
def test_unavailable_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = megatron_unavailable_reason(_megatron_cfg())
    assert reason is not None and "needs a CUDA GPU" in reason and "\n" not in reason


@NEEDS_MEGATRON
def test_unavailable_reasons_past_the_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_unavailable_reason(_megatron_cfg()) is None
    bad = megatron_unavailable_reason(
        _megatron_cfg("trainer.ranks=3", "trainer.groups_per_step=3", "trainer.backend.tensor_parallel=2")
    )
    assert bad is not None and bad.startswith("trainer.backend: world size 3")
    assert "trainer.lora is not supported" in megatron_unavailable_reason(_megatron_cfg("trainer.lora={}"))
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "model_type": "gpt2"}))
    reason = megatron_unavailable_reason(_megatron_cfg("model.type=pretrained", f"model.path={tmp_path}"))
    assert reason is not None and "model_type 'gpt2'" in reason


@NEEDS_MEGATRON
@pytest.mark.parametrize(
    "hf",
    [
        LLAMA,
        DEEPSEEK,
        {**LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8},
    ],
)
def test_megatron_accepts_the_translated_config(hf: dict) -> None:
    from miles.backends.megatron.config import transformer_config

    args = translate(hf)
    config = transformer_config(args, MegatronSettings(tensor_parallel=2), cpu=True)
    assert config.num_layers == hf["num_hidden_layers"] and config.calculate_per_token_loss
    assert config.tensor_model_parallel_size == 2 and config.hidden_dropout == 0.0
    assert type(config).__name__ == ("MLATransformerConfig" if args.mla else "TransformerConfig")


@NEEDS_MEGATRON
def test_miles_prepare_without_a_gpu_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from miles.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = str(Path(__file__).parents[2] / "recipes" / "quickstart.yaml")
    assert main(["prepare", recipe, "--set", "trainer.backend.type=megatron"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [
        "miles: error: trainer.backend.type=megatron needs a CUDA GPU (none is visible); use trainer.backend.type=fsdp"
    ]
