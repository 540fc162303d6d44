"""The converter interface: HF checkpoint tensors <-> megatron-core parameters, one tensor at a time.

Three concerns, kept apart so that an architecture only has to describe its names:

* **Names and fusion** (per family, :class:`Converter`): a table from each *canonical* megatron-core name
  to the HF tensors it is made of and how they are fused (:class:`Copy`, :class:`Concat`,
  :class:`FusedQKV`, or a family's own :class:`Mapping`). Canonical names are those of megatron-core's
  local (non-TransformerEngine) layer spec with *global* layer and expert indices, e.g.
  ``decoder.layers.7.mlp.experts.local_experts.42.linear_fc1.weight``; :data:`TE_ALIASES` maps them to
  the TransformerEngine spec's names, :class:`LocalNames` to a pipeline stage's / expert rank's indices.
* **Tensor-parallel sharding** (shared, :func:`shard_rule`, :func:`shard`, :func:`merge`): a property of
  megatron-core's modules (column-, row-, vocab-parallel, the gate/up pair), not of the architecture.
* **Expert parallelism** (shared, :class:`LocalNames`): which experts an EP rank holds.

A *full* megatron tensor is the tensor a TP=1 model would hold. ``hf_to_mcore`` builds it from the HF
tensors and cuts this rank's shard; export gathers the shards, :func:`merge`\\ s them back into the full
tensor and splits that into HF tensors, so no rank ever needs more than one parameter at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch
from torch import Tensor

HfGetter = Callable[[str], Tensor]  # HF name -> tensor (e.g. a lazy safetensors reader)


class Shard(Enum):
    """How megatron-core splits a parameter over the tensor-parallel ranks."""

    REPLICATED = "replicated"  # norms, routers, experts (expert TP = 1)
    COLUMN = "column"  # output rows, contiguous chunks (q/k/v groups, heads)
    ROW = "row"  # input columns, contiguous chunks (attention output, MLP down)
    GLU = "glu"  # [gate; up]: each rank holds [gate_r; up_r]
    VOCAB = "vocab"  # rows of the (padded) vocabulary


# --------------------------------------------------------------------------- fusion of HF tensors


class Mapping(Protocol):
    """How one canonical megatron tensor is made of HF tensors (and back)."""

    hf_names: tuple[str, ...]

    def to_mcore(self, tensors: Sequence[Tensor]) -> Tensor: ...

    def to_hf(self, full: Tensor) -> list[Tensor]: ...


@dataclass(frozen=True, slots=True)
class Copy:
    """One HF tensor is the megatron tensor; ``pad_rows`` appends zero rows (the padded vocabulary)."""

    hf_name: str
    pad_rows: int = 0

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf_name,)

    def to_mcore(self, tensors: Sequence[Tensor]) -> Tensor:
        (t,) = tensors
        if not self.pad_rows:
            return t
        return torch.cat([t, t.new_zeros((self.pad_rows, *t.shape[1:]))])

    def to_hf(self, full: Tensor) -> list[Tensor]:
        return [full[: full.shape[0] - self.pad_rows] if self.pad_rows else full]


@dataclass(frozen=True, slots=True)
class Concat:
    """HF tensors stacked along dim 0 (MLP gate and up; MLA's latent and rotary key rows)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.names

    def to_mcore(self, tensors: Sequence[Tensor]) -> Tensor:
        got = tuple(t.shape[0] for t in tensors)
        if got != self.sizes:
            raise ValueError(f"{self.names}: rows {got}, expected {self.sizes}")
        return torch.cat(list(tensors))

    def to_hf(self, full: Tensor) -> list[Tensor]:
        return list(torch.split(full, list(self.sizes)))


@dataclass(frozen=True, slots=True)
class FusedQKV:
    """Megatron's fused QKV: per query group ``g``, the group's query heads, then its key and value head.

    ``(groups * (heads_per_group + 2) * head_dim, ...)``; weights and biases alike (any trailing dims).
    Chunking that along dim 0 into TP pieces gives each rank whole groups, which is why TP must divide
    the number of key-value heads.
    """

    names: tuple[str, str, str]  # q, k, v
    heads: int
    groups: int
    head_dim: int

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.names

    def to_mcore(self, tensors: Sequence[Tensor]) -> Tensor:
        q, k, v = tensors
        per = self.heads // self.groups
        rest = q.shape[1:]
        q = q.reshape(self.groups, per * self.head_dim, *rest)
        k = k.reshape(self.groups, self.head_dim, *rest)
        v = v.reshape(self.groups, self.head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def to_hf(self, full: Tensor) -> list[Tensor]:
        per = self.heads // self.groups
        rest = full.shape[1:]
        grouped = full.reshape(self.groups, (per + 2) * self.head_dim, *rest)
        q, k, v = torch.split(grouped, [per * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


# --------------------------------------------------------------------------- the per-family interface


class Converter(Protocol):
    """One architecture family's names: everything :func:`hf_to_mcore` and export need."""

    family: str

    def mappings(self) -> dict[str, Mapping]:
        """Canonical megatron name -> its :class:`Mapping`, for every parameter (and persistent buffer)
        of the whole model, in a stable order (layers ascending)."""
        ...


def shard_rule(name: str) -> Shard:
    """The TP split of a canonical megatron name (a property of megatron-core's module types)."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return Shard.VOCAB
    if ".mlp.experts." in name or name.endswith(("layernorm.weight", "layer_norm_weight", "norm.weight")):
        return Shard.REPLICATED
    if ".router." in name:
        return Shard.REPLICATED
    if name.endswith("linear_fc1.weight"):
        return Shard.GLU
    if name.endswith(("linear_fc2.weight", "linear_proj.weight")):
        return Shard.ROW
    if re.search(r"\.linear_(qkv|q_proj|q_down_proj|q_up_proj|kv_down_proj|kv_up_proj)\.(weight|bias)$", name):
        return Shard.COLUMN
    raise ValueError(f"{name}: no tensor-parallel rule")


def shard(rule: Shard, full: Tensor, tp_rank: int, tp_size: int, local_shape: Sequence[int] | None = None) -> Tensor:
    """This rank's piece of ``full``. A ``local_shape`` equal to the full shape means the module keeps the
    tensor whole on every rank (e.g. TransformerEngine's duplicated MLA down-projections)."""
    if tp_size == 1 or rule is Shard.REPLICATED or (local_shape is not None and tuple(local_shape) == full.shape):
        return full
    if rule in (Shard.COLUMN, Shard.VOCAB):
        return full.chunk(tp_size, dim=0)[tp_rank]
    if rule is Shard.ROW:
        return full.chunk(tp_size, dim=1)[tp_rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])


def merge(rule: Shard, shards: Sequence[Tensor]) -> Tensor:
    """Inverse of :func:`shard`: the full tensor from every TP rank's piece, in rank order."""
    if len(shards) == 1 or rule is Shard.REPLICATED:
        return shards[0]
    if rule in (Shard.COLUMN, Shard.VOCAB):
        return torch.cat(list(shards), dim=0)
    if rule is Shard.ROW:
        return torch.cat(list(shards), dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


# --------------------------------------------------------------------------- local <-> canonical names

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")

# TransformerEngine spec name -> canonical (local spec) name, for the parts of a layer name after the index.
TE_ALIASES: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}
_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


@dataclass(frozen=True, slots=True)
class LocalNames:
    """Where this rank's parameters sit in the whole model: its pipeline stage's layers (local index ->
    global index, from megatron's ``layer_number``) and its expert-parallel slice of the experts."""

    layers: dict[int, int]
    expert_offset: int = 0

    def canonical(self, local_name: str) -> str:
        """A model chunk's ``state_dict`` key as a canonical name (global indices, local-spec names)."""
        m = _LAYER.match(local_name)
        if m is None:
            return local_name
        rest = m.group(2)
        rest = TE_ALIASES.get(rest, rest)
        te = _TE_EXPERT.match(rest)
        if te is not None:
            rest = f"mlp.experts.local_experts.{te.group(2)}.{te.group(1)}.weight"
        e = _EXPERT.match(rest)
        if e is not None:
            rest = f"{e.group(1)}{int(e.group(2)) + self.expert_offset}{e.group(3)}"
        return f"decoder.layers.{self.layers[int(m.group(1))]}.{rest}"


def is_persistent_extra(name: str) -> bool:
    """``state_dict`` entries that are not weights (TransformerEngine's ``_extra_state``)."""
    return name.endswith("_extra_state")


# --------------------------------------------------------------------------- the two directions


def hf_to_mcore(
    converter: Converter,
    hf_get: HfGetter,
    local_shapes: dict[str, tuple[int, ...]],
    names: LocalNames,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, Tensor]:
    """This rank's megatron tensors for the model chunk whose ``state_dict`` shapes are ``local_shapes``.

    Each HF tensor is read (``hf_get``) only by the ranks that hold a piece of it, one at a time; a shape
    that does not match raises naming the parameter.
    """
    table = converter.mappings()
    out: dict[str, Tensor] = {}
    for local_name, shape in local_shapes.items():
        if is_persistent_extra(local_name):
            continue
        name = names.canonical(local_name)
        mapping = table.get(name)
        if mapping is None:
            raise KeyError(f"{local_name} (canonical {name}): not produced by the {converter.family} converter")
        full = mapping.to_mcore([hf_get(n) for n in mapping.hf_names])
        piece = shard(shard_rule(name), full, tp_rank, tp_size, shape)
        if tuple(piece.shape) != tuple(shape):
            raise ValueError(f"{local_name}: converted shape {tuple(piece.shape)}, model expects {tuple(shape)}")
        out[local_name] = piece
    return out


def mcore_to_hf_iter(converter: Converter, full_tensors: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """HF tensors from a stream of ``(canonical name, full megatron tensor)``, one HF tensor at a time."""
    table = converter.mappings()
    for name, full in full_tensors:
        mapping = table[name]
        yield from zip(mapping.hf_names, mapping.to_hf(full), strict=True)


def hf_names_of(converter: Converter, names: Sequence[str]) -> list[str]:
    """The HF names that the canonical megatron ``names`` export to, in order."""
    table = converter.mappings()
    return [hf for name in names for hf in table[name].hf_names]
