"""Streaming the policy out of megatron-core in HF names, one parameter at a time.

For every canonical megatron parameter, in the converter's order (layers ascending), on every rank:

1. the ranks of one *source group* hold it: the TP group of its pipeline stage with data- and
   context-parallel rank 0 (experts: its expert-parallel rank, expert-data-parallel rank 0);
2. that group all-gathers the TP shards (only for tensor-parallel parameters) and merges them into the
   full tensor (:func:`~miles.backends.megatron.converters.base.merge`);
3. the group's first rank sends it to the exporting rank (global rank 0) unless it is rank 0;
4. rank 0 splits it into HF tensors (:func:`mcore_to_hf_iter`) and yields them as float32 on CPU; every
   other rank yields the same names with empty tensors.

So at most one full parameter is in flight on any rank, and no rank gathers the model. Every rank must
run the generator to the end: the gathers and sends are collective. The plan (who sources what, with
which shape) is agreed once per process with one ``all_gather_object``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.megatron.config import McoreModelArgs
from miles.backends.megatron.converters.base import Converter, LocalNames, Shard, merge, shard_rule
from miles.backends.megatron.model import local_names, named_weights
from miles.backends.megatron.settings import MegatronSettings
from miles.sync.precision import to_rollout_state

log = structlog.get_logger(__name__)
DST = 0  # the exporting rank


@dataclass(frozen=True, slots=True)
class Source:
    """Where one full parameter comes from: the global rank that sends it, its full shape and dtype."""

    rank: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(slots=True)
class _Held:
    tensor: Tensor
    tp_sharded: bool
    is_source_group: bool
    expert: bool


def _held_here(chunks: list[torch.nn.Module], settings: MegatronSettings, args: McoreModelArgs) -> dict[str, _Held]:
    """This rank's parameters by canonical name, and whether it belongs to each one's source group."""
    from megatron.core import parallel_state as ps

    dense_source = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    expert_source = ps.get_expert_data_parallel_rank() == 0 if args.num_experts else False
    tp_size = ps.get_tensor_model_parallel_world_size()
    held: dict[str, _Held] = {}
    for chunk in chunks:
        names: LocalNames = local_names(chunk, settings, args)
        for local, tensor in named_weights(chunk):
            canonical = names.canonical(local)
            expert = ".mlp.experts." in canonical
            sharded = _tp_sharded(canonical, tensor, tp_size, args)
            held[canonical] = _Held(tensor, sharded, expert_source if expert else dense_source, expert)
    return held


def _tp_sharded(name: str, tensor: Tensor, tp_size: int, args: McoreModelArgs) -> bool:
    """Whether ``tensor`` is one TP rank's piece. By module type (:func:`shard_rule`; megatron only tags
    parameters it initialised itself), except MLA's down-projections, which TransformerEngine's spec keeps
    whole on every rank and the local spec shards: told apart by their size."""
    if tp_size == 1 or shard_rule(name) is Shard.REPLICATED:
        return False
    tr = args.transformer
    if name.endswith("linear_q_down_proj.weight"):
        return tensor.shape[0] != tr["q_lora_rank"]
    if name.endswith("linear_kv_down_proj.weight"):
        return tensor.shape[0] != tr["kv_lora_rank"] + tr["qk_pos_emb_head_dim"]
    return True


def _full_shape(held: _Held, tp_size: int, name: str) -> tuple[int, ...]:
    shape = list(held.tensor.shape)
    if held.tp_sharded:
        dim = 1 if shard_rule(name) is Shard.ROW else 0
        shape[dim] *= tp_size
    return tuple(shape)


def export_plan(held: dict[str, _Held]) -> dict[str, Source]:
    """Every rank's view of who sends which parameter (one ``all_gather_object``). Collective."""
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    first_of_tp = ps.get_tensor_model_parallel_rank() == 0
    mine = {}
    for name, h in held.items():
        # experts are not TP-sharded: their one expert-data-parallel-rank-0 holder sends, whatever its TP rank
        if h.is_source_group and (first_of_tp or h.expert):
            mine[name] = Source(dist.get_rank(), _full_shape(h, tp_size, name), str(h.tensor.dtype))
    gathered: list[dict[str, Source]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    plan: dict[str, Source] = {}
    for part in gathered:
        for name, src in part.items():
            plan.setdefault(name, src)  # tied copies (e.g. embeddings on two stages): first source wins
    return plan


def _gather_full(name: str, held: _Held) -> Tensor:
    """The full tensor from this TP group's shards (collective over the TP group)."""
    from megatron.core import parallel_state as ps

    local = held.tensor.detach()
    if not held.tp_sharded:
        return local
    group = ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    return merge(shard_rule(name), shards)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def export_hf(
    chunks: list[torch.nn.Module],
    converter: Converter,
    settings: MegatronSettings,
    args: McoreModelArgs,
    plan: dict[str, Source] | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """``(HF name, tensor)`` for the whole model, full float32 CPU tensors on rank 0, empty elsewhere.
    Collective: every rank iterates to the end."""
    held = _held_here(chunks, settings, args)
    plan = export_plan(held) if plan is None else plan
    rank = dist.get_rank()
    table = converter.mappings()
    missing = [n for n in table if n not in plan]
    if missing:
        raise KeyError(f"no rank holds {missing[:3]} (model and converter disagree)")
    for name, mapping in table.items():
        src = plan[name]
        mine = held.get(name)
        full: Tensor | None = None
        if mine is not None and mine.is_source_group:
            full = _gather_full(name, mine)
        if rank == src.rank and rank != DST:
            dist.send(full.contiguous(), dst=DST)
        elif rank == DST and src.rank != DST:
            device = next(iter(held.values())).tensor.device
            full = torch.empty(src.shape, dtype=_dtype(src.dtype), device=device)
            dist.recv(full, src=src.rank)
        if rank == DST:
            assert full is not None
            for hf_name, tensor in zip(mapping.hf_names, mapping.to_hf(full), strict=True):
                yield hf_name, tensor.to(device="cpu", dtype=torch.float32)
        else:
            for hf_name in mapping.hf_names:
                yield hf_name, torch.empty(0)


def rollout_stream(stream: Iterator[tuple[str, Tensor]], precision: str) -> Iterator[tuple[str, Tensor]]:
    """The exported tensors at rollout precision (``sync.dtype``: bf16, fp32, FP8 codes + ``.qscale``, FP4),
    one HF tensor at a time, with the same codec as :func:`miles.sync.precision.to_rollout_state`. Empty
    tensors (ranks other than the exporting one) pass through."""
    for name, tensor in stream:
        if tensor.numel() == 0:
            yield name, tensor
            continue
        yield from to_rollout_state({name: tensor}, precision).items()
