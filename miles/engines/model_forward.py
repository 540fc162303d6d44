"""The model call of the torch engine: HF's forward, or a lean one for Llama-architecture decoders.

Both take the engine's running-batch tensors and return the last position's logits (:data:`Forward`).

Why a lean forward: the engine calls the model once per token boundary. On a small model (the
quickstart's 2-layer Llama) most of an HF forward is Python around the compute - decorators, output
capture, kwarg plumbing and above all mask building - and it costs more than the matmuls (py-spy of a
rollout worker: the HF forward was two thirds of the engine thread). This module computes the same thing
from the same modules' weights in the fewest torch calls: one boolean mask per forward (SDPA's causal
kernel for an unpadded prefill), fused RMSNorm where it rounds as HF does (float32), HF's own rotary
module (so every ``rope_scaling`` variant stays HF's), SDPA. ``benchmarks/lean_forward.py`` measures it
against the HF forward; ``tests/unit/test_model_forward.py`` checks it gives HF's logits and cache, padded
rows included.

It reads the weights from the modules at call time, so in-place weight copies (the engine's switches)
apply to it at once. It is used only where :func:`lean_forward_for` finds exactly the architecture it
implements; everything else keeps the HF forward, and ``rollout.engine.forward: hf`` forces that.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import DynamicCache

# (ids (B, Q), mask (B, T) with T = cached + Q, positions (B, Q), cache) -> logits (B, V) at the last position
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache], torch.Tensor]


def select_forward(model: Any, mode: Literal["auto", "hf"]) -> tuple[Forward, str]:
    """The forward the engine calls and a line saying which one and why (``rollout.engine.forward``)."""
    if mode == "auto":
        lean, why = lean_forward_for(model)
        if lean is not None:
            return lean, f"lean ({why})"
        return hf_forward(model), f"hf ({why})"
    return hf_forward(model), "hf (rollout.engine.forward: hf)"


def hf_forward(model: Any) -> Forward:
    """The model's own forward, asked for its cache and for the last position's logits only.

    transformers renamed both kwargs over time (``past_key_values`` -> ``cache``, ``num_logits_to_keep``
    -> ``logits_to_keep``); we ask the signature rather than pin a version.
    """
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    extra: dict[str, Any] = {"use_cache": True}
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            extra[name] = 1
            break

    def forward(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{cache_arg: cache}, **extra)
        return out.logits[:, -1, :]

    return forward


def lean_forward_for(model: Any) -> tuple[Forward | None, str]:
    """The lean forward of ``model`` and why, or ``(None, why not)`` where the HF forward must serve."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    if type(model) is not LlamaForCausalLM:
        return None, f"{type(model).__name__} is not LlamaForCausalLM"
    config = model.config
    if getattr(config, "hidden_act", None) != "silu":
        return None, f"hidden_act {config.hidden_act!r}, not 'silu'"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return None, f"pretraining_tp {config.pretraining_tp}"
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        # Exact classes: a wrapped Linear (an adapter, a quantized layer) or MLP computes something else.
        if any(type(m) is not torch.nn.Linear or m.bias is not None for m in linears) or type(mlp) is not LlamaMLP:
            return None, f"layer {index} has adapted, quantized or biased projections"
        if type(layer.input_layernorm) is not LlamaRMSNorm or type(layer.post_attention_layernorm) is not LlamaRMSNorm:
            return None, f"layer {index} has another norm than LlamaRMSNorm"
    return _LlamaLean(model), "LlamaForCausalLM: silu MLP, bias-free projections"


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    # The fused op rounds once; HF's module rounds to the input dtype before the weight multiply, which
    # only float32 makes the same. Other dtypes run HF's module.
    if x.dtype is torch.float32 and norm.weight.dtype is torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as HF's ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _LlamaLean:
    """The lean forward of one ``LlamaForCausalLM`` (checked by :func:`lean_forward_for`)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        inner = self.model.model
        batch, queries = ids.shape
        hidden = inner.embed_tokens(ids)  # (B, Q, H); the module, so hooks on it see every forward
        cos, sin = inner.rotary_emb(hidden, positions)  # (B, Q, D) each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, Q, D): broadcast over heads
        columns = mask.shape[1]
        allowed: torch.Tensor | None = mask.bool()[:, None, None, :]  # (B, 1, 1, T): padding is never attended
        causal = False
        if queries > 1 and queries == columns and bool(mask.all()):
            allowed, causal = None, True  # an unpadded prefill: SDPA's causal kernel, as HF asks for it
        elif queries > 1:
            triangle = torch.ones(queries, columns, dtype=torch.bool, device=ids.device).tril(columns - queries)
            # A padding query then attends to nothing: torch's SDPA (>= 2.5) returns zeros for it, not NaN.
            allowed = allowed & triangle  # (B, 1, Q, T)
        for index, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(layer.input_layernorm, hidden)
            q = F.linear(x, attn.q_proj.weight).view(batch, queries, -1, attn.head_dim).transpose(1, 2)
            k = F.linear(x, attn.k_proj.weight).view(batch, queries, -1, attn.head_dim).transpose(1, 2)
            v = F.linear(x, attn.v_proj.weight).view(batch, queries, -1, attn.head_dim).transpose(1, 2)
            k, v = cache.update(_rotate(k, cos, sin), v, index)  # (B, kv_heads, T, D)
            out = F.scaled_dot_product_attention(
                _rotate(q, cos, sin),
                k,
                v,
                attn_mask=allowed,
                is_causal=causal,
                scale=attn.scaling,
                enable_gqa=k.shape[1] != q.shape[1],
            )  # (B, heads, Q, D)
            hidden = hidden + F.linear(out.transpose(1, 2).reshape(batch, queries, -1), attn.o_proj.weight)
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            gated = F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight)
            hidden = hidden + F.linear(gated, mlp.down_proj.weight)
        last = _rms_norm(inner.norm, hidden[:, -1, :])  # (B, H): only the last position's logits are used
        return self.model.lm_head(last)  # (B, V)
