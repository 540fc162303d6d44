"""Shared pieces of the Megatron CPU tests: tiny HF models per family, a 1-rank megatron-core setup on CPU,
Miles-style packed micro-batches, and HF reference log-probs.

Named ``test_*`` only so that it lives next to the tests it serves; its own test checks the packing helper.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from miles.backends.base import MicroBatch

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
VOCAB = 61  # odd on purpose: TP-padding of the vocabulary is exercised at TP = 2


def tiny_hf_config(kind: str) -> Any:
    """A 2-3 layer config of ``kind`` with every feature its family converter handles."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, rms_norm_eps=1e-6)
    common.update(max_position_embeddings=128, tie_word_embeddings=False)
    if kind == "llama":
        return tf.LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **common)
    if kind == "llama_pad":  # HF gives the embedding padding_idx=0: that row never gets a gradient
        return tf.LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, pad_token_id=0, **common)
    if kind == "qwen2":
        return tf.Qwen2Config(num_hidden_layers=2, num_key_value_heads=2, **common)
    if kind == "qwen3":
        return tf.Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, **common)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            num_hidden_layers=3, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, mlp_only_layers=[0], norm_topk_prob=True, **common,
        )  # fmt: skip
    if kind == "deepseek_v3":
        return tf.DeepseekV3Config(
            num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, n_shared_experts=1, moe_intermediate_size=16,
            routed_scaling_factor=2.5, **common,
        )  # fmt: skip
    raise KeyError(kind)


@lru_cache(maxsize=None)
def tiny_hf(kind: str) -> tuple[Any, dict[str, Tensor]]:
    """A seeded tiny model (every weight randomised, norms around 1) and its checkpoint tensors by name."""
    import transformers as tf
    from safetensors.torch import load_file

    config = tiny_hf_config(kind)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        disk = load_file(os.path.join(tmp, "model.safetensors"))
    return model, disk


def pack_rows(rows: list[list[list[int]]], width: int, pad: int = 0) -> MicroBatch:
    """A Miles micro-batch: each row holds the given sequences back to back, right-padded to ``width``;
    every target after the first token of a sequence is trained on (``loss_mask`` 1)."""
    n = len(rows)
    ids = torch.full((n, width), pad, dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    targets = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width))
    seq_index = torch.full((n, width), -1, dtype=torch.long)
    seq = 0
    for r, sequences in enumerate(rows):
        at = 0
        for s in sequences:
            ids[r, at : at + len(s)] = torch.tensor(s)
            pos[r, at : at + len(s)] = torch.arange(len(s))
            targets[r, at : at + len(s) - 1] = torch.tensor(s[1:])
            mask[r, at + 1 : at + len(s) - 1] = 1.0
            seq_index[r, at : at + len(s) - 1] = seq
            at += len(s)
            seq += 1
    return MicroBatch(input_ids=ids, position_ids=pos, targets=targets, loss_mask=mask, seq_index=seq_index)


def sample_batch(vocab: int, seed: int = 0) -> MicroBatch:
    """Two rows, two and one sequences, with padding."""
    g = torch.Generator().manual_seed(seed)

    def seq(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    return pack_rows([[seq(7), seq(5)], [seq(9)]], width=14)


@torch.no_grad()
def hf_logprobs(model: Any, batch: MicroBatch, temperature: float = 1.0) -> Tensor:
    """Reference ``(R, L)`` log-probs: every sequence run alone through the HF model."""
    from miles.algo.logprobs import token_logprobs
    from miles.backends.megatron.batches import segment_ids

    out = torch.zeros(batch.targets.shape)
    seg = segment_ids(batch.position_ids)
    for r in range(batch.input_ids.shape[0]):
        for s in torch.unique(seg[r]).tolist():
            idx = (seg[r] == s).nonzero().flatten()
            logits = model(input_ids=batch.input_ids[r, idx].unsqueeze(0)).logits
            out[r, idx] = token_logprobs(logits, batch.targets[r, idx].unsqueeze(0), temperature)[0]
    return out


def mcore_logprobs(chunk: Any, args: Any, batch: MicroBatch, temperature: float = 1.0) -> Tensor:
    """``(R, L)`` log-probs from a megatron chunk via the ``mask`` layout (no grad)."""
    from miles.backends.megatron.batches import mask_layout
    from miles.backends.megatron.logprobs import vocab_parallel_logprobs

    mb = mask_layout(batch)
    with torch.no_grad():
        logits = chunk(mb.input_ids, mb.position_ids, attention_mask=mb.attention_mask)
        logp, _ = vocab_parallel_logprobs(logits, mb.targets, vocab_size=args.vocab_size, temperature=temperature)
    return mb.scatter(logp)


@dataclass
class CpuMegatron:
    """Handle of the 1-rank megatron-core setup that :func:`cpu_model` enters."""

    def build(self, args: Any, settings: Any) -> Any:
        import dataclasses

        from miles.backends.megatron.model import build_chunks

        torch.manual_seed(1)
        (chunk,) = build_chunks(args, dataclasses.replace(settings, bf16=False), cpu=True)
        return chunk.eval()

    def load(self, chunk: Any, args: Any, disk: dict[str, Tensor]) -> None:
        from miles.backends.megatron.converters import converter_for
        from miles.backends.megatron.model import load_hf_weights
        from miles.backends.megatron.settings import MegatronSettings

        load_hf_weights([chunk], converter_for(args), disk.__getitem__, MegatronSettings(), args)

    def packed_batch(self, vocab: int) -> MicroBatch:
        return sample_batch(vocab)


@contextmanager
def cpu_model() -> Iterator[CpuMegatron]:
    """A 1-rank gloo group with megatron's model-parallel state (TP = PP = 1) and the CPU shims."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles.backends.megatron.cpu_shims import cpu_megatron
    from miles.ports import free_port

    joined = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        joined = True
    ps.initialize_model_parallel(1, 1)
    try:
        with cpu_megatron():
            yield CpuMegatron()
    finally:
        ps.destroy_model_parallel()
        if joined:
            dist.destroy_process_group()


def test_pack_rows_marks_targets_of_each_sequence() -> None:
    batch = pack_rows([[[5, 6, 7], [8, 9]]], width=6)
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert batch.targets.tolist() == [[6, 7, 0, 9, 0, 0]]
    assert batch.seq_index.tolist() == [[0, 0, -1, 1, -1, -1]]
    assert batch.loss_mask.tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
