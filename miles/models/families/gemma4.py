"""Gemma-4: sliding-window / global attention 5:1, wider global heads with K = V, optional MoE beside the MLP.

transformers has the exact text class (``Gemma4ForCausalLM``, model type ``gemma4_text``); released
checkpoints are the multimodal ``gemma4`` (``Gemma4ForConditionalGeneration``). The recipe's variant is
the 26B-A4B MoE, which exercises the most code paths (sliding window, K = V global layers, 128 experts
in parallel with a dense MLP); the 31B dense variant is listed too. The small E2B/E4B variants (per-layer
embeddings, KV sharing across layers) are not.
"""

from __future__ import annotations

from typing import Any

from miles.models.families.base import (
    COMMON_EXCLUDE,
    FP8_TENSOR,
    ChatFormat,
    LoraTargets,
    ModelFamily,
    MoeLayout,
    QuantRule,
)
from miles.models.families.config import TinyDims

TURN_END = "<turn|>"

CHAT_TEMPLATE = r"""{{- bos_token -}}
{%- set system = messages[0].content if (messages and messages[0].role == 'system') else none -%}
{%- if enable_thinking or system is not none -%}
{{- '<|turn>system\n' + ('<|think|>' if enable_thinking else '') + (system or '') + '<turn|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
{{- '<|turn>user\n' + m.content + '<turn|>\n' -}}
{%- elif m.role == 'assistant' -%}
{{- '<|turn>model\n' -}}
{%- if m.reasoning_content -%}{{- '<|channel>thought\n' + m.reasoning_content + '<channel|>' -}}{%- endif -%}
{{- m.content or '' -}}
{%- for tc in m.tool_calls or [] -%}
{{- '<|tool_call>call:' + tc.function.name + '{' -}}
{%- if tc.function.arguments is mapping -%}
{%- for k, v in tc.function.arguments.items() -%}
{{- k + ':' + ('<|"|>' + v + '<|"|>' if v is string else v | tojson) + (',' if not loop.last else '') -}}
{%- endfor -%}
{%- else -%}{{- tc.function.arguments -}}{%- endif -%}
{{- '}<tool_call|>' -}}
{%- endfor -%}
{{- '<turn|>\n' -}}
{%- elif m.role == 'tool' -%}
{{- '<|turn>user\n<|tool_response>response:' + (m.name or 'tool') + '{value:<|"|>' + m.content + '<|"|>}' -}}
{{- '<tool_response|><turn|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- endif -%}"""

CHAT = ChatFormat(
    template=CHAT_TEMPLATE,
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    special_tokens=(
        "<|turn>",
        TURN_END,
        "<|think|>",
        "<|channel>",
        "<channel|>",
        "<|tool>",
        "<tool|>",
        "<|tool_call>",
        "<tool_call|>",
        "<|tool_response>",
        "<tool_response|>",
    ),
    added_tokens=('<|"|>',),
    stop_tokens=(TURN_END, "<eos>", "<|tool_response>"),
    end_of_turn=TURN_END,
    reasoning="Thinking is switched on by '<|think|>' in the system turn; the model then writes "
    "'<|channel>thought\\n..<channel|>' before its answer.",
    tool_calls="'<|tool_call>call:NAME{key:<|\"|>string<|\"|>,n:1}<tool_call|>' (strings delimited by the "
    "<|\"|> token); results as '<|tool_response>response:NAME{..}<tool_response|>'. The real template keeps "
    "call and response inside one model turn (the model yields by emitting '<|tool_response>', hence a stop "
    "token); this one puts the response in a user turn.",
    notes="Gemma 4 replaced Gemma 3's <start_of_turn>/<end_of_turn> with the asymmetric <|turn>/<turn|>.",
)

# Gemma 4 26B-A4B text model: 25.2B parameters on the meta device. Unsure (from memory): the 2,112-wide dense
# MLP beside the 704-wide experts, 2 global KV heads.
FULL_26B: dict[str, Any] = {
    "vocab_size": 262144,
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 2,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "max_position_embeddings": 262144,
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0,
    "enable_moe_block": True,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

# Gemma 4 31B dense: 30.7B parameters on the meta device. Unsure (from memory): 4 global KV heads.
FULL_31B: dict[str, Any] = {
    **{k: v for k, v in FULL_26B.items() if k not in ("num_experts", "top_k_experts", "moe_intermediate_size")},
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 60,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "num_global_key_value_heads": 4,
    "enable_moe_block": False,
}


def tiny_kwargs(vocab_size: int, dims: TinyDims) -> dict[str, Any]:
    """Tiny Gemma-4 (26B-A4B shape): sliding window 8, then global; K = V global heads twice as wide; MoE."""
    h = dims.hidden_size
    return {
        "vocab_size": vocab_size,
        "vocab_size_per_layer_input": vocab_size,
        "hidden_size": h,
        "intermediate_size": 3 * h // 2,
        "num_hidden_layers": dims.num_layers,
        # Alternating, and the last layer global (Gemma 4 requires it).
        "layer_types": [
            "sliding_attention" if i % 2 == 0 and i < dims.num_layers - 1 else "full_attention"
            for i in range(dims.num_layers)
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": h // 4,
        "global_head_dim": h // 2,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "sliding_window": 8,
        "max_position_embeddings": 512,
        "final_logit_softcapping": 30.0,
        "hidden_size_per_layer_input": 0,
        "enable_moe_block": True,
        "num_experts": dims.num_experts,
        "top_k_experts": dims.experts_per_token,
        "moe_intermediate_size": h + 32,
        "tie_word_embeddings": True,
    }


FAMILY = ModelFamily(
    name="gemma4",
    display_name="Gemma-4",
    architecture="Gemma4ForCausalLM",
    model_type="gemma4_text",
    checkpoint_model_types=("gemma4", "gemma4_text"),
    class_note="Exact text class. Released checkpoints are multimodal (gemma4 -> Gemma4ForConditionalGeneration "
    "under AutoModelForCausalLM, weights under model.language_model.*); a text-only run loads Gemma4ForCausalLM "
    "from text_config.",
    attention="5 sliding-window layers (window 1024, local RoPE) per global layer (proportional RoPE on 25% "
    "of a 512-wide head, keys reused as values, fewer KV heads); final logits soft-capped at 30.",
    variants={"26b-a4b": FULL_26B, "31b": FULL_31B},
    published_params_b={"26b-a4b": (25.2, 3.8), "31b": (31.0, 31.0)},
    default_variant="26b-a4b",
    tiny_kwargs=tiny_kwargs,
    chat=CHAT,
    lora=LoraTargets(
        modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        expert_parameters=("experts.gate_up_proj", "experts.down_proj"),
        notes="Global (K = V) layers have no v_proj; the dense MLP runs beside the experts in every layer.",
    ),
    quant=QuantRule(
        linear=FP8_TENSOR,
        experts=FP8_TENSOR,
        exclude=(*COMMON_EXCLUDE, r"\.router\."),
        notes="No native low-precision format (the release is bf16): Miles' per-tensor FP8 for linear layers and "
        "experts; the router (proj, scale, per-expert scale) stays bf16.",
    ),
    moe=MoeLayout(
        experts_module="experts",
        weight_layout="out_in",
        gate_up="concat",
        checkpoint_experts="fused",
        router="router: RMS-normed input, proj -> softmax top-k, renormalised, times per_expert_scale",
        shared_experts=None,
        dense_layers="every layer: a dense MLP in parallel with the MoE block (outputs summed), so no shared expert",
        notes="Experts hang off the decoder layer (layers.N.experts), not off mlp.",
    ),
    variant_notes={"31b": "dense: no MoE block", "26b-a4b": "MoE: 128 experts, 8 active, beside a dense MLP"},
)
