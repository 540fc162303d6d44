"""Building megatron-core ``GPTModel`` chunks from :class:`McoreModelArgs` and loading HF weights into them.

One chunk per virtual pipeline stage of this rank (one chunk without virtual PP). Layer specs come from
megatron-core's own ``get_gpt_decoder_block_spec`` (TransformerEngine spec when TE is importable and
wanted, the local spec otherwise), so dense/MoE layer patterns and PP layer offsets are megatron's.
Needs ``megatron.core.parallel_state`` initialised (a 1-rank gloo group is enough on CPU).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import structlog
import torch

from miles.backends.megatron.compat import patch_megatron, with_eager_mla_attention
from miles.backends.megatron.config import McoreModelArgs, padded_vocab_size, transformer_config
from miles.backends.megatron.converters.base import Converter, HfGetter, LocalNames, hf_to_mcore, is_persistent_extra
from miles.backends.megatron.settings import MegatronSettings

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

log = structlog.get_logger(__name__)


def te_available() -> bool:
    """Whether TransformerEngine is importable (not imported here)."""
    return importlib.util.find_spec("transformer_engine") is not None


def wants_te(settings: MegatronSettings) -> bool:
    """TE on ``"on"``, off on ``"off"``, when importable on ``"auto"``."""
    if settings.transformer_engine == "on" and not te_available():
        raise RuntimeError("trainer.backend.transformer_engine=on but transformer_engine is not installed")
    return settings.transformer_engine == "on" or (settings.transformer_engine == "auto" and te_available())


def fused_norm_available() -> bool:
    """Sequence parallelism needs a norm that megatron can sequence-shard: TransformerEngine's or Apex's
    (megatron-core's torch-norm fallback refuses it)."""
    return te_available() or importlib.util.find_spec("apex") is not None


def build_chunks(
    args: McoreModelArgs, settings: MegatronSettings, *, cpu: bool = False, use_te: bool = False
) -> list[GPTModel]:
    """This rank's model chunks, weights allocated but not loaded (see :func:`load_hf_weights`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    patch_megatron()
    sequence_parallel = settings.uses_sequence_parallel and (use_te or fused_norm_available())
    if settings.uses_sequence_parallel and not sequence_parallel:
        if args.num_experts and not cpu:  # megatron-core refuses to train MoE + TP without SP
            raise RuntimeError("MoE with tensor_parallel > 1 needs sequence parallelism: install transformer-engine")
        log.warning("megatron.sequence_parallel_off", reason="no TransformerEngine or Apex norm")
    config = transformer_config(args, settings, cpu=cpu, transformer_engine=use_te, sequence_parallel=sequence_parallel)
    vp = settings.virtual_pipeline_parallel
    chunks: list[GPTModel] = []
    for stage in range(vp or 1):
        vp_stage = stage if vp else None
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
        )
        if args.mla and not use_te:
            spec.layer_specs = with_eager_mla_attention(spec.layer_specs)
        gpt_kwargs = dict(args.gpt)
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(args.vocab_size, settings.tensor_parallel),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,  # logits stay vocab-parallel; log-probs reduce over TP (logprobs.py)
            vp_stage=vp_stage,
            **gpt_kwargs,
        )
        if config.bf16:
            _to_bf16(chunk)
        if not cpu:
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    return chunks


def _to_bf16(chunk: torch.nn.Module) -> None:
    """Every weight in bf16, as megatron's ``Float16Module`` casts it (its torch-norm fallback is built in
    float32), except the routers' expert-score bias, which megatron keeps in float32 and HF stores so."""
    chunk.bfloat16()
    for module in chunk.modules():
        bias = module._buffers.get("expert_bias")
        if bias is not None:
            module._buffers["expert_bias"] = bias.float()


def local_names(chunk: torch.nn.Module, settings: MegatronSettings, args: McoreModelArgs) -> LocalNames:
    """The chunk's layer indices (megatron's 1-based ``layer_number``) and this rank's first expert."""
    from megatron.core import parallel_state as ps

    layers = {}
    decoder = getattr(chunk, "decoder", None)
    for i, layer in enumerate(getattr(decoder, "layers", [])):
        layers[i] = int(layer.layer_number) - 1
    offset = 0
    if args.num_experts:
        offset = ps.get_expert_model_parallel_rank() * (args.num_experts // settings.expert_parallel)
    return LocalNames(layers=layers, expert_offset=offset)


def weight_shapes(chunk: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``state_dict`` names and shapes of the weights and persistent buffers (no TE extra state)."""
    return {
        k: tuple(v.shape)
        for k, v in chunk.state_dict().items()
        if isinstance(v, torch.Tensor) and not is_persistent_extra(k)
    }


@torch.no_grad()
def load_hf_weights(
    chunks: list[torch.nn.Module],
    converter: Converter,
    hf_get: HfGetter,
    settings: MegatronSettings,
    args: McoreModelArgs,
) -> None:
    """Copy this rank's shards of the HF weights into ``chunks`` (every parameter must be covered), and give
    the embedding HF's ``padding_idx`` gradient rule (:func:`freeze_padding_row`)."""
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for chunk in chunks:
        names = local_names(chunk, settings, args)
        tensors = hf_to_mcore(converter, hf_get, weight_shapes(chunk), names, tp_rank, tp_size)
        targets = {k: v for k, v in chunk.state_dict(keep_vars=True).items() if k in tensors}
        missing = set(weight_shapes(chunk)) - set(tensors)
        if missing:
            raise KeyError(f"no HF tensor for {sorted(missing)[:3]}")
        for name, tensor in tensors.items():
            target = targets[name]
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
    freeze_padding_row(chunks, args)
    log.info("megatron.weights_loaded", family=converter.family, chunks=len(chunks), tp_rank=tp_rank)


def freeze_padding_row(chunks: list[torch.nn.Module], args: McoreModelArgs) -> None:
    """Zero the gradient of the embedding row of ``pad_token_id``, as HF's ``nn.Embedding(padding_idx=...)``
    does, so that a sampled pad token trains the same way under both backends. Only the TP rank whose
    vocabulary shard holds the row changes anything."""
    from megatron.core import parallel_state as ps

    pad = args.hf.get("padding_idx")
    if pad is None:
        return
    for chunk in chunks:
        embedding = getattr(unwrap(chunk), "embedding", None)
        if embedding is None:
            continue
        weight = embedding.word_embeddings.weight
        start = ps.get_tensor_model_parallel_rank() * weight.shape[0]
        if start <= pad < start + weight.shape[0]:
            row = pad - start
            weight.register_hook(lambda grad, row=row: grad.index_fill(0, torch.tensor([row], device=grad.device), 0.0))


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside megatron's DDP / Float16Module wrappers."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def named_weights(chunk: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(state_dict name, tensor)`` of a chunk's weights and persistent buffers, in ``state_dict`` order."""
    for name, value in unwrap(chunk).state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor) and not is_persistent_extra(name):
            yield name, value
