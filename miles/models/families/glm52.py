"""GLM-5.2: the GLM-5 stack (744B, 40B active): MLA + DeepSeek Sparse Attention, 256 routed experts.

transformers has no GLM-5.2 class; the closest is ``GlmMoeDsaForCausalLM`` (model type ``glm_moe_dsa``),
GLM-5's architecture, whose defaults are the 744B model. ``glm5_next`` (GLM-5.3) is a different, hybrid
stack (KDA linear attention, NoPE DSA layers, multi-stream residuals) and is not used. This is the family
of the reference release's 64-GPU terminal-task run.
"""

from __future__ import annotations

from typing import Any

from miles.models.families.base import COMMON_EXCLUDE, FP8_BLOCK128, ChatFormat, ModelFamily, MoeLayout, QuantRule
from miles.models.families.config import TinyDims
from miles.models.families.deepseek_v32 import MLA_LORA, mla_dims

EOT, USER, OBSERVATION = "<|endoftext|>", "<|user|>", "<|observation|>"

CHAT_TEMPLATE = r"""{{- '[gMASK]<sop>' -}}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{{- '<|system|>\n' + m.content -}}
{%- elif m.role == 'user' -%}
{{- '<|user|>\n' + m.content -}}
{%- elif m.role == 'assistant' -%}
{{- '<|assistant|>' -}}
{{- ('<think>' + m.reasoning_content + '</think>') if m.reasoning_content else '</think>' -}}
{{- m.content or '' -}}
{%- for tc in m.tool_calls or [] -%}
{{- '<tool_call>' + tc.function.name -}}
{%- if tc.function.arguments is mapping -%}
{%- for k, v in tc.function.arguments.items() -%}
{{- '<arg_key>' + k + '</arg_key><arg_value>' + (v if v is string else v | tojson) + '</arg_value>' -}}
{%- endfor -%}
{%- else -%}{{- tc.function.arguments -}}{%- endif -%}
{{- '</tool_call>' -}}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{{- '<|observation|><tool_response>' + m.content + '</tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>' + ('<think>' if enable_thinking else '</think>') -}}
{%- endif -%}"""

CHAT = ChatFormat(
    template=CHAT_TEMPLATE,
    bos=None,
    eos=EOT,
    pad=EOT,
    special_tokens=("[gMASK]", "<sop>", "<|system|>", USER, "<|assistant|>", OBSERVATION),
    added_tokens=(
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<tool_response>",
        "</tool_response>",
    ),
    stop_tokens=(EOT, USER, OBSERVATION),
    end_of_turn=None,
    reasoning="'<think>..</think>' right after '<|assistant|>'; a non-thinking turn opens with '</think>'.",
    tool_calls="'<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>..</tool_call>'; the model then "
    "emits '<|observation|>' and the result comes back as '<|observation|><tool_response>..</tool_response>'.",
    notes="No end-of-turn token: an assistant turn ends when the model emits the next role marker "
    "('<|user|>' or '<|observation|>'), which is why both are stop tokens. An agent loop that appends the next "
    "turn after such a stop must not render the marker again. Newlines after the role markers follow GLM-4.5; "
    "unsure whether GLM-5 keeps them.",
)

# GLM-5 (744B-A40B): 743.9B parameters on the meta device (the class defaults). Unsure: rope_theta.
FULL_744B: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "kv_lora_rank": 512,
    "q_lora_rank": 2048,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "pad_token_id": 154820,
    "eos_token_id": [154820, 154827, 154829],
    "tie_word_embeddings": False,
}


def tiny_kwargs(vocab_size: int, dims: TinyDims) -> dict[str, Any]:
    """Tiny GLM-5.2: MLA + DSA like DeepSeek-V3.2, with GLM's wider value heads (v_head_dim > qk_nope_head_dim)."""
    h = dims.hidden_size
    base = mla_dims(dims)
    base.pop("rope_parameters")
    return {
        **base,
        "vocab_size": vocab_size,
        "qk_nope_head_dim": 3 * h // 8,
        "v_head_dim": h // 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "index_topk": 8,
        "index_head_dim": 16,
        "index_n_heads": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


FAMILY = ModelFamily(
    name="glm52",
    display_name="GLM-5.2",
    architecture="GlmMoeDsaForCausalLM",
    model_type="glm_moe_dsa",
    checkpoint_model_types=("glm_moe_dsa",),
    class_note="Closest class: GlmMoeDsaForCausalLM (GLM-5 architecture); transformers has no GLM-5.2 class. "
    "glm5_next (GLM-5.3) is a different hybrid architecture.",
    attention="MLA (latent KV cache) with the DSA indexer (index_topk keys per query); the indexer of a layer "
    "may reuse the previous layer's top-k ('shared' indexer_types).",
    variants={"744b-a40b": FULL_744B},
    published_params_b={"744b-a40b": (744.0, 40.0)},
    default_variant="744b-a40b",
    tiny_kwargs=tiny_kwargs,
    chat=CHAT,
    lora=MLA_LORA,
    quant=QuantRule(
        linear=FP8_BLOCK128,
        experts=FP8_BLOCK128,
        exclude=(*COMMON_EXCLUDE, r"\.mlp\.gate\.weight$", r"indexer\.weights_proj", r"e_score_correction_bias"),
        notes="BF16 is the main release; the official -FP8 checkpoint uses FP8 with 128x128 block scales "
        "(assumed the DeepSeek-V3 layout, weight_scale_inv).",
    ),
    moe=MoeLayout(
        experts_module="mlp.experts",
        weight_layout="out_in",
        gate_up="concat",
        checkpoint_experts="per_expert",
        router="mlp.gate: sigmoid scores + e_score_correction_bias, one group, routed_scaling_factor 2.5",
        shared_experts="mlp.shared_experts (1 shared expert)",
        dense_layers="the first 3 layers (first_k_dense_replace) have a dense MLP",
    ),
)
