"""GPT-OSS: alternating sliding-window (128) and full attention with learned attention sinks, MXFP4 experts.

transformers has the exact class (``GptOssForCausalLM``). The released experts are MXFP4 (e2m1 codes,
one e8m0 scale per 32 input features) stored as ``*_blocks`` / ``*_scales``; attention, router and
embeddings are bf16. The fused expert tensors are laid out ``(E, in, out)``, with gate and up
*interleaved* along the output axis, unlike every other family here.
"""

from __future__ import annotations

from typing import Any

from miles.models.families.base import COMMON_EXCLUDE, MXFP4, ChatFormat, LoraTargets, ModelFamily, MoeLayout, QuantRule
from miles.models.families.config import TinyDims

RETURN, CALL, END, EOT = "<|return|>", "<|call|>", "<|end|>", "<|endoftext|>"

# Harmony: the system header is shortened (no knowledge cutoff / date lines) but keeps the channel rules.
CHAT_TEMPLATE = r"""{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n' -}}
{{- 'Reasoning: ' + (reasoning_effort or 'medium') + '\n\n' -}}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' -}}
{%- if messages and messages[0].role == 'system' -%}
{{- '<|start|>developer<|message|># Instructions\n\n' + messages[0].content + '<|end|>' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}
{%- elif m.role == 'assistant' -%}
{%- if m.reasoning_content -%}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' -}}
{%- endif -%}
{%- if m.tool_calls -%}
{%- for tc in m.tool_calls -%}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + tc.function.name + ' <|constrain|>json<|message|>' -}}
{{- (tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson) + '<|call|>' -}}
{%- endfor -%}
{%- else -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|end|>' -}}
{%- endif -%}
{%- elif m.role == 'tool' -%}
{{- '<|start|>functions.' + (m.name or 'tool') + ' to=assistant<|channel|>commentary<|message|>' + m.content -}}
{{- '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"""

CHAT = ChatFormat(
    template=CHAT_TEMPLATE,
    bos="<|startoftext|>",
    eos=RETURN,
    pad=EOT,
    special_tokens=("<|start|>", END, "<|message|>", "<|channel|>", "<|constrain|>", CALL, EOT),
    stop_tokens=(RETURN, CALL, EOT),
    end_of_turn=END,
    reasoning="Harmony channels: reasoning in '<|channel|>analysis', the answer in '<|channel|>final'; "
    "'Reasoning: low|medium|high' in the system message sets the effort. '<|end|>' closes a message but not "
    "the turn, so it is not a stop token.",
    tool_calls="'<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}"
    "<|call|>'; results as '<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>..<|end|>'.",
    notes="The model ends its final answer with <|return|>; the rendered history closes that message with "
    "<|end|> instead. Token-in/token-out keeps the sampled <|return|>; re-rendering would change that token.",
)

# gpt-oss-120b: 116.8B parameters on the meta device.
FULL_120B: dict[str, Any] = {
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "pad_token_id": 199999,
    "eos_token_id": 200002,
    "tie_word_embeddings": False,
}

# gpt-oss-20b: 20.9B parameters on the meta device.
FULL_20B: dict[str, Any] = {**FULL_120B, "num_hidden_layers": 24, "num_local_experts": 32}


def tiny_kwargs(vocab_size: int, dims: TinyDims) -> dict[str, Any]:
    """Tiny GPT-OSS: sliding window 8 then full, sinks, yarn RoPE; expert width hidden + 32.

    The expert width keeps every expert input axis a multiple of the MXFP4 block (32) and makes
    ``gate_up_proj`` (E, h, 2(h + 32)) and ``down_proj`` (E, h + 32, h) unambiguous about which axis is which.
    """
    h = dims.hidden_size
    return {
        "vocab_size": vocab_size,
        "hidden_size": h,
        "intermediate_size": h + 32,
        "num_hidden_layers": dims.num_layers,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(dims.num_layers)],
        "num_local_experts": dims.num_experts,
        "num_experts_per_tok": dims.experts_per_token,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": h // 4,
        "sliding_window": 8,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
        "tie_word_embeddings": False,
    }


FAMILY = ModelFamily(
    name="gpt_oss",
    display_name="GPT-OSS",
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    checkpoint_model_types=("gpt_oss",),
    class_note="",
    attention="Sliding window (128) and full attention alternate; every head has a learned sink logit "
    "(self_attn.sinks) in its softmax; GQA 64/8; yarn RoPE (factor 32).",
    variants={"120b": FULL_120B, "20b": FULL_20B},
    published_params_b={"120b": (117.0, 5.1), "20b": (21.0, 3.6)},
    default_variant="120b",
    tiny_kwargs=tiny_kwargs,
    chat=CHAT,
    lora=LoraTargets(
        modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        expert_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
        notes="Attention projections (with biases, which stay frozen); experts only through peft target_parameters.",
    ),
    quant=QuantRule(
        linear=None,
        experts=MXFP4,
        exclude=(*COMMON_EXCLUDE, r"\.router\.", r"\.sinks$"),
        notes="Only the experts are MXFP4 in the release, blocked along the input features: axis 1 of "
        "gate_up_proj (E, hidden, 2I) and of down_proj (E, I, hidden). Expert biases, sinks, attention stay bf16.",
    ),
    moe=MoeLayout(
        experts_module="mlp.experts",
        weight_layout="in_out",
        gate_up="interleaved",
        checkpoint_experts="fused",
        router="mlp.router: linear with bias, top-k then softmax over the k",
        shared_experts=None,
        dense_layers="none: every layer is MoE",
        notes="Experts have biases (gate_up_proj_bias, down_proj_bias) and a clamped SwiGLU (limit 7, alpha 1.702, "
        "up + 1). The release stores gate_up_proj_blocks/_scales; transformers dequantizes them to bf16 on load "
        "when no MXFP4 kernel is available.",
    ),
    variant_notes={"120b": "36 layers, 128 experts", "20b": "24 layers, 32 experts"},
)
