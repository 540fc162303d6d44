"""Kimi-K2.6: a DeepSeek-V3-shaped 1T MoE (MLA, 384 experts, 8 active) under a vision wrapper.

transformers has no causal-LM class for ``kimi_k25`` (the multimodal wrapper K2.5/K2.6 checkpoints
declare): its ``text_config`` is a ``deepseek_v3`` config, so the closest class, and the one the tiny
twin uses, is ``DeepseekV3ForCausalLM``. The routed experts are released in INT4 (weight-only, group 32,
quantization-aware trained, as K2-Thinking and K2.5 were); attention, shared experts and the dense layer
stay bf16.
"""

from __future__ import annotations

from typing import Any

from miles.models.families.base import COMMON_EXCLUDE, INT4_G32, ChatFormat, ModelFamily, MoeLayout, QuantRule
from miles.models.families.config import TinyDims
from miles.models.families.deepseek_v32 import MLA_LORA, mla_dims

IM_END = "<|im_end|>"

CHAT_TEMPLATE = r"""{%- if not messages or messages[0].role != 'system' -%}
{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{{- '<|im_system|>system<|im_middle|>' + m.content + '<|im_end|>' -}}
{%- elif m.role == 'user' -%}
{{- '<|im_user|>user<|im_middle|>' + m.content + '<|im_end|>' -}}
{%- elif m.role == 'assistant' -%}
{{- '<|im_assistant|>assistant<|im_middle|><think>' + (m.reasoning_content or '') + '</think>' + (m.content or '') -}}
{%- if m.tool_calls -%}
{{- '<|tool_calls_section_begin|>' -}}
{%- for tc in m.tool_calls -%}
{{- '<|tool_call_begin|>' + (tc.id or 'functions.' + tc.function.name + ':' + loop.index0 | string) -}}
{{- '<|tool_call_argument_begin|>' -}}
{{- tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson -}}
{{- '<|tool_call_end|>' -}}
{%- endfor -%}
{{- '<|tool_calls_section_end|>' -}}
{%- endif -%}
{{- '<|im_end|>' -}}
{%- elif m.role == 'tool' -%}
{{- '<|im_system|>tool<|im_middle|>## Return of ' + (m.tool_call_id or '') + '\n' + m.content + '<|im_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_assistant|>assistant<|im_middle|><think>' + ('' if enable_thinking else '</think>') -}}
{%- endif -%}"""

CHAT = ChatFormat(
    template=CHAT_TEMPLATE,
    bos="[BOS]",
    eos="[EOS]",
    pad="[PAD]",
    special_tokens=(
        "<|im_system|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_middle|>",
        IM_END,
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
    added_tokens=("<think>", "</think>"),
    stop_tokens=(IM_END, "[EOS]"),
    end_of_turn=IM_END,
    reasoning="'<think>reasoning</think>' opens every assistant turn; non-thinking turns carry an empty "
    "'<think></think>'.",
    tool_calls="'<|tool_calls_section_begin|>' then per call '<|tool_call_begin|>functions.NAME:IDX"
    "<|tool_call_argument_begin|>{json}<|tool_call_end|>', then '<|tool_calls_section_end|>'; results as a "
    "'tool' system turn starting '## Return of <call id>'.",
    notes="Default system prompt when none is given, as the real template does. The tokenizer's eos is [EOS]; "
    "chat turns end with <|im_end|>, which must be a stop token.",
)

# Text model of Kimi-K2.6 (DeepSeek-V3 layout); 1.03T parameters (checked on the meta device).
# Unsure: the yarn betas (Kimi's configs use beta_fast = beta_slow = 1) and the 262,144-token context of
# K2.5+ (factor 64 over 4,096), written from memory of the K2 family's configs.
FULL_1T: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "tie_word_embeddings": False,
}


def tiny_kwargs(vocab_size: int, dims: TinyDims) -> dict[str, Any]:
    """Tiny Kimi: the DeepSeek-V3 MLA stack without DSA, one expert group, one dense layer first."""
    return {**mla_dims(dims), "vocab_size": vocab_size, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827}


FAMILY = ModelFamily(
    name="kimi_k26",
    display_name="Kimi-K2.6",
    architecture="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    checkpoint_model_types=("kimi_k25", "kimi_k2", "deepseek_v3"),
    class_note="Closest class: DeepseekV3ForCausalLM. Kimi-K2.6 checkpoints are model type kimi_k25 "
    "(MoonViT vision tower + a deepseek_v3 text_config); transformers 5.24 has no causal-LM mapping for it, so "
    "a full-size text-only run loads DeepseekV3ForCausalLM from text_config and the language-model weights.",
    attention="MLA (latent KV cache), dense attention (no DSA indexer), 64 heads.",
    variants={"1t-a32b": FULL_1T},
    published_params_b={"1t-a32b": (1040.0, 32.0)},
    default_variant="1t-a32b",
    tiny_kwargs=tiny_kwargs,
    chat=CHAT,
    lora=MLA_LORA,
    quant=QuantRule(
        linear=None,
        experts=INT4_G32,
        exclude=(*COMMON_EXCLUDE, r"\.mlp\.gate\.weight$", r"e_score_correction_bias"),
        notes="Only routed experts are INT4 (group 32 along the input features) in the release; everything else "
        "is bf16. Assumed for K2.6 from K2-Thinking/K2.5 (native INT4 via QAT).",
    ),
    moe=MoeLayout(
        experts_module="mlp.experts",
        weight_layout="out_in",
        gate_up="concat",
        checkpoint_experts="per_expert",
        router="mlp.gate: sigmoid scores + e_score_correction_bias, one group, routed_scaling_factor 2.827",
        shared_experts="mlp.shared_experts (1 shared expert)",
        dense_layers="the first layer (first_k_dense_replace 1) has a dense MLP",
    ),
)
