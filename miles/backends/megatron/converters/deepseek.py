"""DeepSeek-V3 style: multi-latent attention (MLA) and MoE with shared experts and a routing-score bias.

MLA names (HF -> megatron ``MLASelfAttention``): ``q_a_proj`` -> ``linear_q_down_proj``, ``q_a_layernorm``
-> ``q_layernorm``, ``q_b_proj`` -> ``linear_q_up_proj`` (``q_proj`` -> ``linear_q_proj`` without a query
latent), ``kv_a_proj_with_mqa`` -> ``linear_kv_down_proj``, ``kv_a_layernorm`` -> ``kv_layernorm``,
``kv_b_proj`` -> ``linear_kv_up_proj``, ``o_proj`` -> ``linear_proj``. Per head both sides order the
query as ``[no-rope; rope]`` and the up-projected key-value as ``[key; value]``.

RoPE layout: megatron-core's MLA always rotates dimension pairs ``(2i, 2i+1)`` (it de-interleaves the
rotary part of q and k, ``[0, 2, 4, ..., 1, 3, 5, ...]``, before ``rotate_half``), which is HF's
``rope_interleave=True`` (DeepSeek's default): the weights are then copied as they are. For
``rope_interleave=False`` (HF rotates halves) the rotary rows of the query and key projections are
stored in the inverse order, so that megatron's de-interleave restores HF's layout; q and k are permuted
alike, so every attention score is unchanged, and export undoes it (bit-exact).

MoE: router ``mlp.gate.weight`` -> ``mlp.router.weight``, ``mlp.gate.e_score_correction_bias`` ->
``mlp.router.expert_bias`` (float32), shared experts ``mlp.shared_experts.*_proj`` -> ``linear_fc1/2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.backends.megatron.converters.base import Copy, Mapping
from miles.backends.megatron.converters.llama import LlamaConverter, dense_mlp
from miles.backends.megatron.converters.qwen3_moe import routed_experts


def pair_to_half(dim: int) -> Tensor:
    """Index that reorders pairwise-rotated dimensions into half-split ones: ``[0, 2, ..., 1, 3, ...]``."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


@dataclass(frozen=True, slots=True)
class RotaryRows:
    """One HF tensor whose rows come in ``blocks`` equal blocks (heads), each with its rotary rows at
    ``[start, start + rope)``; with ``permute`` those rows are stored so that megatron's de-interleave
    (:func:`pair_to_half`) gives back HF's order (``permute=False``: a plain copy)."""

    hf_name: str
    blocks: int
    start: int
    rope: int
    permute: bool

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf_name,)

    def _apply(self, t: Tensor, index: Tensor) -> Tensor:
        if not self.permute:
            return t
        grouped = t.reshape(self.blocks, -1, *t.shape[1:]).clone()
        rows = grouped[:, self.start : self.start + self.rope]
        grouped[:, self.start : self.start + self.rope] = rows[:, index]
        return grouped.reshape(t.shape)

    def to_mcore(self, tensors: Sequence[Tensor]) -> Tensor:
        (t,) = tensors
        return self._apply(t, torch.argsort(pair_to_half(self.rope)))

    def to_hf(self, full: Tensor) -> list[Tensor]:
        return [self._apply(full, pair_to_half(self.rope))]


class DeepseekConverter(LlamaConverter):
    family = "deepseek"

    def attention(self, layer: int, hf: str) -> dict[str, Mapping]:
        tr = self.tr
        heads, nope, rope = tr["num_attention_heads"], tr["qk_head_dim"], tr["qk_pos_emb_head_dim"]
        interleave = not bool(self.args.hf.get("rope_interleave", True))  # permute only for half-split HF
        out: dict[str, Mapping] = {}
        if tr.get("q_lora_rank"):
            out["self_attention.linear_q_down_proj.weight"] = Copy(f"{hf}.q_a_proj.weight")
            out["self_attention.q_layernorm.weight"] = Copy(f"{hf}.q_a_layernorm.weight")
            out["self_attention.linear_q_up_proj.weight"] = RotaryRows(
                f"{hf}.q_b_proj.weight", heads, nope, rope, interleave
            )
        else:
            out["self_attention.linear_q_proj.weight"] = RotaryRows(
                f"{hf}.q_proj.weight", heads, nope, rope, interleave
            )
        out["self_attention.linear_kv_down_proj.weight"] = RotaryRows(
            f"{hf}.kv_a_proj_with_mqa.weight", 1, tr["kv_lora_rank"], rope, interleave
        )
        out["self_attention.kv_layernorm.weight"] = Copy(f"{hf}.kv_a_layernorm.weight")
        out["self_attention.linear_kv_up_proj.weight"] = Copy(f"{hf}.kv_b_proj.weight")
        out["self_attention.linear_proj.weight"] = Copy(f"{hf}.o_proj.weight")
        return out

    def mlp(self, layer: int, hf: str) -> dict[str, Mapping]:
        if layer not in set(self.args.moe_layers):
            return super().mlp(layer, hf)
        out: dict[str, Mapping] = {
            "mlp.router.weight": Copy(f"{hf}.gate.weight"),
            "mlp.router.expert_bias": Copy(f"{hf}.gate.e_score_correction_bias"),
        }
        out.update(routed_experts(hf, self.tr))
        shared = self.tr.get("moe_shared_expert_intermediate_size")
        if shared:
            out.update(dense_mlp(f"{hf}.shared_experts", "mlp.shared_experts", shared))
        return out
