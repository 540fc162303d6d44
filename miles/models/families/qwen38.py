"""Qwen3.8: the Qwen3.5-generation hybrid MoE (Gated DeltaNet linear attention 3:1 with gated full attention).

Which class stands for "Qwen3.8": ``Qwen3_5MoeForCausalLM`` (model type ``qwen3_5_moe_text``, the text
model of ``qwen3_5_moe``). transformers has no Qwen3.8 class; of the three candidates, ``qwen3`` and
``qwen3_moe`` are the 2025 pure-attention Qwen3 stack, while Qwen3.5 introduced the hybrid linear/full
attention MoE that the later 3.x releases build on. It is also the model class of the 35B-A3B
self-distillation reference run, and the only one of the three that exercises hybrid caches (a
recurrent state plus a conv window per linear-attention layer next to ordinary KV layers).
"""

from __future__ import annotations

from typing import Any

from miles.models.families.base import (
    COMMON_EXCLUDE,
    FP8_BLOCK128,
    ChatFormat,
    LoraTargets,
    ModelFamily,
    MoeLayout,
    QuantRule,
)
from miles.models.families.config import TinyDims

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

CHAT_TEMPLATE = r"""{%- for m in messages -%}
{%- if m.role == 'system' or m.role == 'user' -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- elif m.role == 'assistant' -%}
{{- '<|im_start|>assistant\n<think>\n' + (m.reasoning_content or '') + '\n</think>\n\n' + (m.content or '') -}}
{%- for tc in m.tool_calls or [] -%}
{{- ('\n\n' if m.content else '') if loop.first else '\n' -}}
{{- '<tool_call>\n<function=' + tc.function.name + '>\n' -}}
{%- if tc.function.arguments is mapping -%}
{%- for k, v in tc.function.arguments.items() -%}
{{- '<parameter=' + k + '>\n' + (v if v is string else v | tojson) + '\n</parameter>\n' -}}
{%- endfor -%}
{%- else -%}{{- tc.function.arguments + '\n' -}}{%- endif -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif m.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n<think>\n' + ('' if enable_thinking else '\n</think>\n\n') -}}
{%- endif -%}"""

CHAT = ChatFormat(
    template=CHAT_TEMPLATE,
    bos=None,
    eos=IM_END,
    pad=EOT,
    special_tokens=(IM_START, IM_END, EOT),
    added_tokens=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    stop_tokens=(IM_END, EOT),
    end_of_turn=IM_END,
    reasoning="'<think>\\n..\\n</think>\\n\\n' at the start of the assistant turn; non-thinking prompts end with "
    "an empty block. The real template drops reasoning from turns before the last user message; this one "
    "keeps every turn's block so that a rendered prefix never changes (token-in/token-out).",
    tool_calls="XML (Qwen3-Coder style): '<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n"
    "</function>\\n</tool_call>'; results as a user turn '<tool_response>\\n..\\n</tool_response>'.",
    notes="No BOS. The real template merges consecutive tool results into one user turn; this one gives each "
    "its own turn.",
)

_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}

# Qwen3.5-35B-A3B text model (the class defaults name this checkpoint): 34.7B parameters on the meta device.
FULL_35B: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "full_attention_interval": 4,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": _ROPE,
    "tie_word_embeddings": False,
}

# Qwen3.5-397B-A17B: 396.3B parameters on the meta device. Unsure (from memory): 512 experts / 10 active,
# 64 linear value heads, 32 attention heads.
FULL_397B: dict[str, Any] = {
    **FULL_35B,
    "hidden_size": 4096,
    "num_hidden_layers": 60,
    "num_attention_heads": 32,
    "linear_num_value_heads": 64,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024,
}


def tiny_kwargs(vocab_size: int, dims: TinyDims) -> dict[str, Any]:
    """Tiny Qwen3.8: linear-attention and full-attention layers alternate (1:1 here, 3:1 at full size)."""
    h = dims.hidden_size
    return {
        "vocab_size": vocab_size,
        "hidden_size": h,
        "num_hidden_layers": dims.num_layers,
        "layer_types": ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(dims.num_layers)],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": h // 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": h // 4,
        "linear_value_head_dim": h // 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": dims.num_experts,
        "num_experts_per_tok": dims.experts_per_token,
        "moe_intermediate_size": h + 32,
        "shared_expert_intermediate_size": h + 32,
        "max_position_embeddings": 512,
        "rope_parameters": {**_ROPE, "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    }


FAMILY = ModelFamily(
    name="qwen38",
    display_name="Qwen3.8",
    architecture="Qwen3_5MoeForCausalLM",
    model_type="qwen3_5_moe_text",
    checkpoint_model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    class_note="Closest class: Qwen3_5MoeForCausalLM (Qwen3.5 MoE text model); transformers has no Qwen3.8. "
    "Released checkpoints are the multimodal qwen3_5_moe (vision tower + text_config).",
    attention="Hybrid: 3 of every 4 layers Gated DeltaNet linear attention (a recurrent state and a causal conv "
    "window per layer, no KV), every 4th gated full attention (q_proj also emits the output gate) with "
    "partial (25%) multimodal RoPE.",
    variants={"35b-a3b": FULL_35B, "397b-a17b": FULL_397B},
    published_params_b={"35b-a3b": (35.0, 3.0), "397b-a17b": (397.0, 17.0)},
    default_variant="35b-a3b",
    tiny_kwargs=tiny_kwargs,
    chat=CHAT,
    lora=LoraTargets(
        modules=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"),
        expert_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
        notes="Full-attention projections plus the linear-attention input (qkv, z gate) and output projections; "
        "the tiny decay/beta projections (in_proj_a/b) and the conv are left frozen.",
    ),
    quant=QuantRule(
        linear=FP8_BLOCK128,
        experts=FP8_BLOCK128,
        exclude=(
            *COMMON_EXCLUDE,
            r"\.mlp\.gate\.weight$",
            r"shared_expert_gate",
            r"linear_attn\.(in_proj_a|in_proj_b|conv1d|A_log|dt_bias)",
        ),
        notes="BF16 is the main release; the official -FP8 checkpoints use FP8 with 128x128 block scales. "
        "Unsure which small linear-attention tensors those leave in bf16 (here: a/b projections, conv, decay).",
    ),
    moe=MoeLayout(
        experts_module="mlp.experts",
        weight_layout="out_in",
        gate_up="concat",
        checkpoint_experts="per_expert",
        router="mlp.gate: softmax top-k, renormalised",
        shared_experts="mlp.shared_expert with a sigmoid mlp.shared_expert_gate (1 x hidden)",
        dense_layers="none: every layer is MoE",
    ),
)
