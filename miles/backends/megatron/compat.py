"""What megatron-core 0.16 lacks without TransformerEngine, supplied without changing its behaviour.

* ``moe_utils.te_general_gemm`` is only bound when TransformerEngine imports, yet the MoE router's gating
  tests ``te_general_gemm is not None``: without TE every MoE forward raises ``NameError``. Binding the
  name to ``None`` takes the router's own plain-torch branch, which is what that test intends.
* ``multi_latent_attention`` sets ``HAVE_TE = True`` when megatron's TE extension module imports, which it
  does without TE (binding ``TELinear`` to a mock), then calls ``isinstance(..., TELinear)``: a ``TypeError``
  when building any MLA layer. Its ``HAVE_TE`` is set to what it means: ``TELinear`` is a real class.
* Multi-latent attention's local spec passes ``k_channels`` / ``v_channels`` to the core attention, which
  megatron-core's local ``DotProductAttention`` does not accept (MLA is TE-only upstream).
  :class:`EagerCoreAttention` is a small masked-softmax attention with separate key and value head sizes
  for that case; with TE installed megatron-core's own ``TEDotProductAttention`` is used instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn


def patch_megatron() -> None:
    """Apply the shims above (idempotent). Called before any model is built."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


class EagerCoreAttention(nn.Module):
    """``softmax(q k^T * scale + mask) v`` over ``[s, b, heads, dim]`` tensors, float32 softmax.

    The mask is megatron's: boolean ``(b, 1, sq, sk)``, True where attention is *not* allowed (causal and
    block-diagonal for packed sequences, :mod:`miles.backends.megatron.batches`).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        if config.context_parallel_size > 1:
            raise ValueError("EagerCoreAttention does not support context parallelism (install TransformerEngine)")
        dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)

    def forward(
        self,
        query: Tensor,  # (sq, b, heads, dk)
        key: Tensor,  # (sk, b, heads, dk)
        value: Tensor,  # (sk, b, heads, dv)
        attention_mask: Tensor | None,  # (b, 1, sq, sk) bool, True = masked
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> Tensor:
        if packed_seq_params is not None:
            raise ValueError("EagerCoreAttention takes a mask, not packed (THD) sequences")
        if attention_mask is None:
            raise ValueError("EagerCoreAttention needs an explicit attention mask")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, d)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale  # (b, h, sq, sk)
        scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # (b, h, sq, dv)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # (sq, b, heads * dv)


def with_eager_mla_attention(layer_specs: list[Any]) -> list[Any]:
    """Copies of megatron's local MLA layer specs whose core attention is :class:`EagerCoreAttention`."""
    out = []
    for spec in layer_specs:
        attn = spec.submodules.self_attention
        sub = dataclasses.replace(attn.submodules, core_attention=EagerCoreAttention)
        layer_sub = dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(attn, submodules=sub))
        out.append(dataclasses.replace(spec, submodules=layer_sub))
    return out
