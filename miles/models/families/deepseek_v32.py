"""DeepSeek-V3.2: MLA + DeepSeek Sparse Attention (a top-k indexer per layer), 256 routed experts, FP8 weights.

transformers has the exact class (``DeepseekV32ForCausalLM``, model type ``deepseek_v32``). The released
weights are FP8 e4m3 with one float32 ``weight_scale_inv`` per 128x128 block, for every linear layer and
expert; embeddings, norms, the router and the unembedding stay bf16.
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

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"

# No Jinja template ships with V3.2 (its encoding is a Python script); this one renders the same
# structure: system text after BOS, "<｜User｜>..<｜Assistant｜>", then "</think>answer" (or
# "<think>reasoning</think>answer") and the end-of-sentence token; tools as DSML invoke blocks.
CHAT_TEMPLATE = r"""{{- bos_token -}}
{%- if messages and messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
{{- '<｜User｜>' + m.content + '<｜Assistant｜>' -}}
{%- elif m.role == 'assistant' -%}
{{- ('<think>' + m.reasoning_content + '</think>') if m.reasoning_content else '</think>' -}}
{{- m.content or '' -}}
{%- if m.tool_calls -%}
{{- '\n\n<｜DSML｜function_calls>\n' -}}
{%- for tc in m.tool_calls -%}
{{- '<｜DSML｜invoke name="' + tc.function.name + '">\n' -}}
{%- if tc.function.arguments is mapping -%}
{%- for k, v in tc.function.arguments.items() -%}
{{- '<｜DSML｜parameter name="' + k + '" string="' + ('true' if v is string else 'false') + '">' -}}
{{- (v if v is string else v | tojson) + '</｜DSML｜parameter>\n' -}}
{%- endfor -%}
{%- else -%}{{- tc.function.arguments + '\n' -}}{%- endif -%}
{{- '</｜DSML｜invoke>\n' -}}
{%- endfor -%}
{{- '</｜DSML｜function_calls>' -}}
{%- endif -%}
{{- '<｜end▁of▁sentence｜>' -}}
{%- elif m.role == 'tool' -%}
{{- '<｜User｜><function_results>\n<result>' + m.content + '</result>\n</function_results><｜Assistant｜>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and messages[-1].role != 'assistant' -%}
{{- '<think>' if enable_thinking else '</think>' -}}
{%- endif -%}"""

CHAT = ChatFormat(
    template=CHAT_TEMPLATE,
    bos=BOS,
    eos=EOS,
    pad=PAD,
    special_tokens=(USER, ASSISTANT),
    added_tokens=("<think>", "</think>", "｜DSML｜"),
    stop_tokens=(EOS,),
    end_of_turn=EOS,
    reasoning="'<think>' opens reasoning right after '<｜Assistant｜>' in thinking mode, '</think>' closes it; "
    "non-thinking turns start with '</think>'. Earlier turns' reasoning is dropped by the real encoder.",
    tool_calls="DSML: '<｜DSML｜function_calls>' wrapping '<｜DSML｜invoke name=\"f\">' blocks of "
    '\'<｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>\'; results come back in a user '
    "turn as '<function_results><result>..</result></function_results>' (result wrapper: best effort).",
    notes="V3.2 ships a Python encoder (encoding_dsv32.py), not a Jinja template: a full-size run must render "
    "prompts with it (or an equivalent) rather than tokenizer.apply_chat_template.",
)

# Dims of DeepSeek-V3.2(-Exp); 671.9B parameters without the MTP layer (checked on the meta device).
FULL_671B: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def mla_dims(dims: TinyDims) -> dict[str, Any]:
    """MLA, MoE and yarn-RoPE kwargs shared by the tiny twins of the DeepSeek-V3-style families.

    Head dims keep the real proportions (rope slice < nope slice, latent ranks below the width) so
    that the decoupled-RoPE split, the latent KV cache and the yarn mscale all run as at full size.
    """
    h = dims.hidden_size
    return {
        "hidden_size": h,
        "intermediate_size": 2 * h,
        "moe_intermediate_size": h + 32,  # expert input axes stay multiples of 32 (int4/mxfp4 groups)
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": dims.num_experts,
        "num_experts_per_tok": dims.experts_per_token,
        "first_k_dense_replace": 1,
        "kv_lora_rank": h // 2,
        "q_lora_rank": 3 * h // 4,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": h // 4,
        "v_head_dim": h // 4,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
    }


def tiny_kwargs(vocab_size: int, dims: TinyDims) -> dict[str, Any]:
    """Tiny DeepSeek-V3.2: MLA + DSA with index_topk 8 (so sparse selection runs past 8 tokens), group routing.

    Eight indexer heads, not two: with two, the ReLU'd index scores of many keys are exactly 0 and the
    top-k then breaks ties differently in prefill and in decode, which is a property of random
    weights, not a cache bug.
    """
    # Two expert groups, one picked per token, when the top-k fits in one group (the real model: 8 and 4).
    fits = dims.num_experts >= 4 and dims.num_experts % 2 == 0 and dims.experts_per_token <= dims.num_experts // 2
    groups = 2 if fits else 1
    return {
        **mla_dims(dims),
        "vocab_size": vocab_size,
        "n_group": groups,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "index_topk": 8,
        "index_head_dim": 16,
        "index_n_heads": 8,
    }


MLA_LORA = LoraTargets(
    modules=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    expert_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    notes="MLA has no q/k/v_proj: adapters go on the low-rank query (q_a, q_b), the joint latent KV "
    "(kv_a_proj_with_mqa) and its up-projection (kv_b_proj), and o_proj. Engines that absorb kv_b_proj into "
    "the query/output (SGLang's MLA) must re-absorb after merging an adapter. The DSA indexer is left out "
    "(it is trained by its own objective, and transformers runs it under no_grad).",
)

FAMILY = ModelFamily(
    name="deepseek_v32",
    display_name="DeepSeek-V3.2",
    architecture="DeepseekV32ForCausalLM",
    model_type="deepseek_v32",
    checkpoint_model_types=("deepseek_v32",),
    class_note="",
    attention="MLA (latent KV cache: kv_lora_rank + rope dims per token) with the DSA indexer: each query "
    "attends to its index_topk highest-scoring keys; the indexer keeps its own key cache per layer.",
    variants={"671b-a37b": FULL_671B},
    published_params_b={"671b-a37b": (671.0, 37.0)},
    default_variant="671b-a37b",
    tiny_kwargs=tiny_kwargs,
    chat=CHAT,
    lora=MLA_LORA,
    quant=QuantRule(
        linear=FP8_BLOCK128,
        experts=FP8_BLOCK128,
        exclude=(*COMMON_EXCLUDE, r"\.mlp\.gate\.weight$", r"indexer\.weights_proj", r"e_score_correction_bias"),
        notes="Every linear layer and expert in FP8 128x128 blocks, as released. Unsure: whether the released "
        "indexer.wq_b / indexer.wk are FP8 (assumed yes) and weights_proj bf16 (assumed).",
    ),
    moe=MoeLayout(
        experts_module="mlp.experts",
        weight_layout="out_in",
        gate_up="concat",
        checkpoint_experts="per_expert",
        router="mlp.gate: sigmoid scores + e_score_correction_bias buffer, group-limited top-k "
        "(n_group 8, topk_group 4), routed_scaling_factor 2.5",
        shared_experts="mlp.shared_experts (1 shared expert, plain gate/up/down_proj)",
        dense_layers="the first 3 layers (first_k_dense_replace) have a dense MLP",
    ),
    notes="The released checkpoint also holds one MTP layer (layer 61), which transformers does not load.",
)
