"""Qwen3-MoE: Qwen3 attention; routed experts on the layers ``moe_layer_freq`` marks, dense MLPs elsewhere.

HF checkpoint names per expert ``e``: ``mlp.experts.{e}.{gate,up,down}_proj.weight``, router
``mlp.gate.weight``. Megatron (``SequentialMLP``; ``TEGroupedMLP`` under its own names, see
``TE_ALIASES``): ``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight`` and ``mlp.router.weight``.
Experts are not TP-sharded (expert TP = 1); an expert-parallel rank holds a contiguous block of experts.
"""

from __future__ import annotations

from miles.backends.megatron.converters.base import Copy, Mapping
from miles.backends.megatron.converters.llama import LlamaConverter, dense_mlp


class Qwen3MoeConverter(LlamaConverter):
    family = "qwen3_moe"

    def mlp(self, layer: int, hf: str) -> dict[str, Mapping]:
        if layer not in set(self.args.moe_layers):
            return super().mlp(layer, hf)
        return {"mlp.router.weight": Copy(f"{hf}.gate.weight"), **routed_experts(hf, self.tr)}


def routed_experts(hf: str, tr: dict) -> dict[str, Mapping]:
    """Every routed expert of one layer, under global expert indices."""
    out: dict[str, Mapping] = {}
    for e in range(tr["num_moe_experts"]):
        out.update(dense_mlp(f"{hf}.experts.{e}", f"mlp.experts.local_experts.{e}", tr["moe_ffn_hidden_size"]))
    return out
