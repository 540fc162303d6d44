"""Dense decoder family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm).

HF names follow the checkpoint layout (``model.layers.{i}.self_attn.q_proj.weight`` ...). Megatron fuses
q/k/v into ``linear_qkv`` (grouped, :class:`FusedQKV`) and gate/up into ``linear_fc1`` (``[gate; up]``).
The MoE families subclass this and replace :meth:`LlamaConverter.mlp`, MLA replaces
:meth:`LlamaConverter.attention`.
"""

from __future__ import annotations

from miles.backends.megatron.config import McoreModelArgs, padded_vocab_size
from miles.backends.megatron.converters.base import Concat, Copy, FusedQKV, Mapping


class LlamaConverter:
    """Names of the dense family; ``tensor_parallel`` only sizes the padded vocabulary."""

    family = "llama"

    def __init__(self, args: McoreModelArgs, tensor_parallel: int = 1) -> None:
        self.args = args
        self.tr = args.transformer
        self.pad_rows = padded_vocab_size(args.vocab_size, tensor_parallel) - args.vocab_size
        self._table: dict[str, Mapping] | None = None

    def mappings(self) -> dict[str, Mapping]:
        if self._table is None:
            table: dict[str, Mapping] = {
                "embedding.word_embeddings.weight": Copy("model.embed_tokens.weight", self.pad_rows)
            }
            for layer in range(self.tr["num_layers"]):
                for rest, mapping in self.layer(layer).items():
                    table[f"decoder.layers.{layer}.{rest}"] = mapping
            table["decoder.final_layernorm.weight"] = Copy("model.norm.weight")
            if not self.args.gpt["share_embeddings_and_output_weights"]:
                table["output_layer.weight"] = Copy("lm_head.weight", self.pad_rows)
            self._table = table
        return self._table

    def layer(self, layer: int) -> dict[str, Mapping]:
        hf = f"model.layers.{layer}"
        out: dict[str, Mapping] = {"input_layernorm.weight": Copy(f"{hf}.input_layernorm.weight")}
        out.update(self.attention(layer, f"{hf}.self_attn"))
        out["pre_mlp_layernorm.weight"] = Copy(f"{hf}.post_attention_layernorm.weight")
        out.update(self.mlp(layer, f"{hf}.mlp"))
        return out

    def attention(self, layer: int, hf: str) -> dict[str, Mapping]:
        heads, groups, dim = self.tr["num_attention_heads"], self.tr["num_query_groups"], self.tr["kv_channels"]
        names = (f"{hf}.q_proj", f"{hf}.k_proj", f"{hf}.v_proj")
        out: dict[str, Mapping] = {
            "self_attention.linear_qkv.weight": FusedQKV(tuple(f"{n}.weight" for n in names), heads, groups, dim),
            "self_attention.linear_proj.weight": Copy(f"{hf}.o_proj.weight"),
        }
        if self.tr.get("add_qkv_bias"):
            out["self_attention.linear_qkv.bias"] = FusedQKV(tuple(f"{n}.bias" for n in names), heads, groups, dim)
        if self.tr.get("qk_layernorm"):
            out["self_attention.q_layernorm.weight"] = Copy(f"{hf}.q_norm.weight")
            out["self_attention.k_layernorm.weight"] = Copy(f"{hf}.k_norm.weight")
        return out

    def mlp(self, layer: int, hf: str) -> dict[str, Mapping]:
        return dense_mlp(hf, "mlp", self.tr["ffn_hidden_size"])


def dense_mlp(hf: str, prefix: str, ffn: int) -> dict[str, Mapping]:
    """A gated MLP (``gate_proj``, ``up_proj``, ``down_proj``) as megatron's ``linear_fc1`` / ``linear_fc2``."""
    return {
        f"{prefix}.linear_fc1.weight": Concat((f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), (ffn, ffn)),
        f"{prefix}.linear_fc2.weight": Copy(f"{hf}.down_proj.weight"),
    }
