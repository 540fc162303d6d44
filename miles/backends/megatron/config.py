"""Hugging Face model config -> megatron-core ``TransformerConfig`` / ``GPTModel`` arguments.

:func:`translate` is pure (no torch, no megatron-core): it reads a HF config (a ``PretrainedConfig`` or its
``config.json`` dict) and returns a :class:`McoreModelArgs` of plain values, so that every supported
architecture is testable on any machine and an unsupported one fails with one line naming the field.
:func:`transformer_config` turns those values plus the parallel layout into the real megatron-core object
(imported lazily).

Families (``McoreModelArgs.family``, each with a converter in :mod:`miles.backends.megatron.converters`):

* ``llama``: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm); dense, GQA.
* ``qwen3_moe``: Qwen3-MoE: Qwen3 attention, softmax top-k routed experts, optional dense layers.
* ``deepseek``: DeepSeek-V3 style: multi-latent attention (MLA), sigmoid group-limited routing with an
  expert-score bias, shared experts, the first ``first_k_dense_replace`` layers dense.

RoPE variants: default, ``linear`` (position interpolation), ``llama3``, ``yarn``; partial rotary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.backends.megatron.settings import MegatronSettings

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek",
}
_ACTIVATIONS = ("silu",)
# megatron-core's llama3 RoPE scaling has these constants built in (only the factor is an argument).
_MCORE_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModelError(ValueError):
    """A HF config this backend cannot reproduce exactly; the message names the field."""


@dataclass(frozen=True, slots=True)
class McoreModelArgs:
    """Everything megatron-core needs to build the model, as plain values.

    ``transformer``: keyword arguments of ``TransformerConfig`` (``MLATransformerConfig`` when ``mla``),
    without the parallel layout and precision, which :func:`transformer_config` adds. ``gpt``: keyword
    arguments of ``GPTModel`` (``vocab_size`` already padded to a multiple of the TP size happens at build).
    ``config_attrs``: attributes megatron-core reads with ``getattr`` but does not declare (dense YaRN).
    """

    family: str
    model_type: str
    vocab_size: int
    transformer: dict[str, Any]
    gpt: dict[str, Any]
    mla: bool = False
    config_attrs: dict[str, Any] = field(default_factory=dict)
    hf: dict[str, Any] = field(default_factory=dict)  # the HF values the converters need (head sizes, ...)

    @property
    def num_experts(self) -> int | None:
        return self.transformer.get("num_moe_experts")

    @property
    def moe_layers(self) -> list[int]:
        """Global indices of the MoE layers (empty for dense models)."""
        freq = self.transformer.get("moe_layer_freq")
        if not self.num_experts or freq is None:
            return []
        return [i for i, is_moe in enumerate(freq) if is_moe]


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    to_dict = getattr(hf_config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise TypeError(f"expected a PretrainedConfig or a dict, got {type(hf_config).__name__}")


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters whichever way the config spells them (transformers 5 ``rope_parameters``,
    older ``rope_theta`` + ``rope_scaling``)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _require(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise UnsupportedModelError(f"HF config has no '{key}'")
    return hf[key]


def translate(hf_config: Any) -> McoreModelArgs:
    """The megatron-core arguments that reproduce ``hf_config``'s forward exactly (up to float rounding)."""
    hf = _as_dict(hf_config)
    model_type = str(hf.get("model_type", ""))
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model_type '{model_type}' has no Megatron converter (supported: {', '.join(sorted(FAMILIES))})"
        )
    act = hf.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act '{act}' is not supported (only {', '.join(_ACTIVATIONS)})")
    if hf.get("sliding_window") and hf.get("use_sliding_window", model_type == "mistral"):
        raise UnsupportedModelError("sliding-window attention is not supported by the Megatron backend")

    heads = int(_require(hf, "num_attention_heads"))
    hidden = int(_require(hf, "hidden_size"))
    head_dim = int(hf.get("head_dim") or hidden // heads)
    transformer: dict[str, Any] = {
        "num_layers": int(_require(hf, "num_hidden_layers")),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": int(hf.get("num_key_value_heads") or heads),
        "ffn_hidden_size": int(_require(hf, "intermediate_size")),
        "kv_channels": head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "gated_linear_unit": True,
        "activation": act,  # resolved to a callable by transformer_config()
        "add_bias_linear": False,
        "add_qkv_bias": bool(hf.get("attention_bias", model_type == "qwen2")),
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe"),
        "hidden_dropout": 0.0,  # RL: the proximal forward and the training forward must agree
        "attention_dropout": 0.0,
        "attention_softmax_in_fp32": True,
    }
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    gpt: dict[str, Any] = {
        "max_sequence_length": int(hf.get("max_position_embeddings", 4096)),
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "position_embedding_type": "rope",
    }
    config_attrs: dict[str, Any] = {}
    pad = hf.get("pad_token_id")
    # HF builds the input embedding with padding_idx=pad_token_id: that row never receives a gradient.
    needs = {"head_dim": head_dim, "rope_interleave": False, "padding_idx": pad if isinstance(pad, int) else None}

    if family == "deepseek":
        _deepseek_attention(hf, transformer, gpt, needs)
    else:
        _rope_args(hf, head_dim, gpt, config_attrs)
    if family == "qwen3_moe":
        _qwen3_moe(hf, transformer)
    elif family == "deepseek":
        _deepseek_moe(hf, transformer)
    return McoreModelArgs(
        family=family,
        model_type=model_type,
        vocab_size=int(_require(hf, "vocab_size")),
        transformer=transformer,
        gpt=gpt,
        mla=family == "deepseek",
        config_attrs=config_attrs,
        hf=needs,
    )


def _rope_args(hf: dict[str, Any], head_dim: int, gpt: dict[str, Any], attrs: dict[str, Any]) -> None:
    rope = _rope(hf)
    kind = rope["rope_type"]
    gpt["rotary_base"] = int(rope["rope_theta"]) if float(rope["rope_theta"]).is_integer() else rope["rope_theta"]
    gpt["rotary_percent"] = float(hf.get("partial_rotary_factor", 1.0))
    if kind == "default":
        return
    factor = float(_require(rope, "factor"))
    if kind == "linear":
        gpt["seq_len_interpolation_factor"] = factor
    elif kind == "llama3":
        for key, value in _MCORE_LLAMA3.items():
            if float(rope.get(key, value)) != value:
                raise UnsupportedModelError(f"llama3 RoPE {key}={rope.get(key)}: megatron-core fixes it at {value}")
        gpt["rope_scaling"] = True
        gpt["rope_scaling_factor"] = factor
    elif kind == "yarn":
        gpt["position_embedding_type"] = "yarn"
        attrs.update(
            yarn_rotary_scaling_factor=factor,
            yarn_original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096)
            ),
            yarn_beta_fast=float(rope.get("beta_fast", 32.0)),
            yarn_beta_slow=float(rope.get("beta_slow", 1.0)),
            yarn_mscale=float(rope.get("mscale", 1.0)),
            yarn_mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
            yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
        )
    else:
        raise UnsupportedModelError(f"RoPE type '{kind}' is not supported")


def _deepseek_attention(hf: dict[str, Any], tr: dict[str, Any], gpt: dict[str, Any], needs: dict[str, Any]) -> None:
    """Multi-latent attention. megatron-core's MLA rotates dimension pairs like HF's ``rope_interleave``;
    the half-split variant is reproduced by permuting rotary weight rows (:mod:`converters.deepseek`)."""
    rope = _rope(hf)
    q_lora = hf.get("q_lora_rank")
    tr.update(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(_require(hf, "kv_lora_rank")),
        qk_head_dim=int(_require(hf, "qk_nope_head_dim")),
        qk_pos_emb_head_dim=int(_require(hf, "qk_rope_head_dim")),
        v_head_dim=int(_require(hf, "v_head_dim")),
        num_query_groups=tr["num_attention_heads"],
        qk_layernorm=True,  # megatron's name for MLA's q_a_layernorm / kv_a_layernorm
        rotary_base=float(rope["rope_theta"]),
    )
    tr.pop("kv_channels")
    needs["rope_interleave"] = bool(hf.get("rope_interleave", True))
    kind = rope["rope_type"]
    if kind == "default":
        tr.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    elif kind == "yarn":
        tr.update(
            rope_type="yarn",
            rotary_scaling_factor=float(_require(rope, "factor")),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
            beta_fast=float(rope.get("beta_fast", 32.0)),
            beta_slow=float(rope.get("beta_slow", 1.0)),
            mscale=float(rope.get("mscale", 1.0)),
            mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
        )
    else:
        raise UnsupportedModelError(f"MLA RoPE type '{kind}' is not supported (default or yarn)")
    gpt["position_embedding_type"] = "rope"  # GPTModel then leaves RoPE to MLA, which builds its own


def _moe_layers(num_layers: int, dense: set[int]) -> list[int]:
    return [0 if i in dense else 1 for i in range(num_layers)]


def _qwen3_moe(hf: dict[str, Any], tr: dict[str, Any]) -> None:
    step = int(hf.get("decoder_sparse_step", 1))
    dense = {int(i) for i in hf.get("mlp_only_layers") or []}
    dense |= {i for i in range(tr["num_layers"]) if (i + 1) % step}
    tr.update(
        num_moe_experts=int(hf.get("num_experts") or _require(hf, "num_local_experts")),  # transformers 5 renamed it
        moe_router_topk=int(_require(hf, "num_experts_per_tok")),
        moe_ffn_hidden_size=int(_require(hf, "moe_intermediate_size")),
        moe_layer_freq=_moe_layers(tr["num_layers"], dense),
        # softmax over all experts then top-k (unnormalised), or top-k logits then softmax (= renormalised)
        moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)),
        moe_router_score_function="softmax",
    )


def _deepseek_moe(hf: dict[str, Any], tr: dict[str, Any]) -> None:
    if hf.get("n_routed_experts") is None:
        return
    topk = int(_require(hf, "num_experts_per_tok"))
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if groups > 1 and topk // group_topk != 2:
        # HF scores a group by its top-2 experts; megatron-core by its top (topk // group_topk).
        raise UnsupportedModelError(f"num_experts_per_tok // topk_group must be 2 for grouped routing, got {topk}")
    if not hf.get("norm_topk_prob", True):
        raise UnsupportedModelError("norm_topk_prob=False with sigmoid routing is not supported")
    shared = int(hf.get("n_shared_experts") or 0)
    dense = set(range(int(hf.get("first_k_dense_replace", 0))))
    freq = int(hf.get("moe_layer_freq", 1))
    dense |= {i for i in range(tr["num_layers"]) if i % freq}
    tr.update(
        num_moe_experts=int(hf["n_routed_experts"]),
        moe_router_topk=topk,
        moe_ffn_hidden_size=int(_require(hf, "moe_intermediate_size")),
        moe_layer_freq=_moe_layers(tr["num_layers"], dense),
        moe_shared_expert_intermediate_size=shared * int(hf["moe_intermediate_size"]) if shared else None,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_pre_softmax=False,
    )


# --------------------------------------------------------------------------- megatron-core objects


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """Megatron's vocab-parallel layers need the vocabulary divisible by TP; the extra rows are padding
    whose logits :mod:`miles.backends.megatron.logprobs` masks out."""
    return int(math.ceil(vocab_size / tensor_parallel) * tensor_parallel)


def parallel_kwargs(settings: MegatronSettings, *, sequence_parallel: bool | None = None) -> dict[str, Any]:
    """The ``ModelParallelConfig`` part of the config; ``sequence_parallel`` overrides the setting (off where
    the norm implementation cannot do it)."""
    return {
        "tensor_model_parallel_size": settings.tensor_parallel,
        "pipeline_model_parallel_size": settings.pipeline_parallel,
        "virtual_pipeline_model_parallel_size": settings.virtual_pipeline_parallel,
        "context_parallel_size": settings.context_parallel,
        "expert_model_parallel_size": settings.expert_parallel,
        "expert_tensor_parallel_size": settings.expert_tensor_parallel,
        "sequence_parallel": settings.uses_sequence_parallel if sequence_parallel is None else sequence_parallel,
    }


def moe_kwargs(args: McoreModelArgs, settings: MegatronSettings) -> dict[str, Any]:
    """Router loss, capacity and dispatch settings (empty for dense models)."""
    if not args.num_experts:
        return {}
    return {
        "moe_aux_loss_coeff": settings.moe_aux_loss_coef,
        "moe_router_load_balancing_type": "aux_loss" if settings.moe_aux_loss_coef > 0 else "none",
        "moe_expert_capacity_factor": settings.moe_capacity_factor,
        "moe_token_drop_policy": settings.moe_token_drop_policy,
        "moe_pad_expert_input_to_capacity": settings.moe_pad_expert_input_to_capacity,
        "moe_token_dispatcher_type": settings.moe_token_dispatcher,
        "moe_router_dtype": "fp32",
        "moe_router_bias_update_rate": settings.moe_expert_bias_update_rate,
        "moe_grouped_gemm": False,
    }


def transformer_config(
    args: McoreModelArgs,
    settings: MegatronSettings,
    *,
    cpu: bool = False,
    transformer_engine: bool = False,
    sequence_parallel: bool | None = None,
) -> TransformerConfig:
    """The megatron-core config object (``MLATransformerConfig`` for MLA). ``cpu``: weights allocated on CPU
    (contract tests and dry runs), else on the current CUDA device; bf16 or float32 per ``settings.bf16``."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kwargs = dict(args.transformer)
    kwargs["activation_func"] = {"silu": F.silu}[kwargs.pop("activation")]
    kwargs.update(parallel_kwargs(settings, sequence_parallel=sequence_parallel))
    kwargs.update(moe_kwargs(args, settings))
    if not args.num_experts:  # unused without experts; megatron's allgather default refuses variable lengths
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    bf16 = settings.bf16
    kwargs.update(
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=cpu,
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        calculate_per_token_loss=True,  # Miles' loss is already a share of the global loss: no rescaling
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        variable_seq_lengths=settings.pipeline_parallel > 1,  # micro-batches differ in length: PP sends shapes
        transformer_impl="transformer_engine" if transformer_engine else "local",
    )
    if settings.recompute != "none":
        kwargs["recompute_granularity"] = settings.recompute
        if settings.recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    cls = MLATransformerConfig if args.mla else TransformerConfig
    config = cls(**kwargs)
    for key, value in args.config_attrs.items():
        setattr(config, key, value)
    return config
