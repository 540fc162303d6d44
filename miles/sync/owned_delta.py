"""Delta sync with no whole state on any rank: each tensor's previous bits live on the rank that owns it.

A delta needs the previously published rollout-precision bits of every tensor. Kept whole on rank 0 (the
way it was), they grow rank 0 by the whole model in rollout precision, the memory blow-up users of every
peer report. Here the tensors of the payload are spread over the trainer ranks (:func:`assign_owners`,
balanced by bytes, the same on every rank), and each rank keeps only its own tensors' previous bits
(:class:`OwnedBase`). Per version, one tensor at a time, in the export's order:

1. the export gathers the parameter on rank 0 (collective, as for a full payload), which converts it to
   rollout precision (:func:`~miles.sync.stream_export.rollout_tensors`);
2. rank 0 sends each converted tensor to its owner (a point-to-point send over a gloo group, one tensor);
3. the owner encodes that tensor's delta record against its previous bits
   (:func:`~miles.sync.delta.encode_delta`), replaces them with the new ones, and sends the record back;
4. rank 0 writes the record into the data plane (format 3 of :mod:`miles.sync.delta` is written as it is
   encoded) and folds the converted tensor into the state digest, then drops both.

A full anchor goes the same way without records: the owners only take the new bits. So every rank holds
its share of the previous state, one tensor in flight and one record; rank 0 never more than its share.
If an export fails part-way, some owners hold new bits and some old: the sender's next version is then an
anchor (:meth:`miles.sync.modes.DeltaSchedule.anchor_reason`), which rewrites every owner's share.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import structlog
import torch
import torch.distributed as dist

from miles.sync.delta import encode_delta
from miles.sync.stream_export import TensorSpec, rollout_specs, rollout_tensors

log = structlog.get_logger(__name__)


def assign_owners(specs: Sequence[TensorSpec], world_size: int) -> dict[str, int]:
    """The rank keeping each rollout tensor's previous bits: largest first to the least-loaded rank (ties to
    the lowest), so every rank holds about ``1 / world_size`` of the bytes. Deterministic: every rank
    computes the same map from the same specs."""
    load = [(0, rank) for rank in range(world_size)]
    owners: dict[str, int] = {}
    for spec in sorted(specs, key=lambda s: (-s.nbytes, s.name)):
        bytes_held, rank = heapq.heappop(load)
        owners[spec.name] = rank
        heapq.heappush(load, (bytes_held + spec.nbytes, rank))
    return owners


@dataclass(frozen=True, slots=True)
class OwnedPlan:
    """Per exported parameter, its rollout tensors (in the order the conversion makes them) and their owners."""

    outputs: dict[str, tuple[TensorSpec, ...]]  # source name -> its rollout tensors
    owners: dict[str, int]  # rollout tensor name -> rank
    precision: str
    family: str | None

    @classmethod
    def of(cls, sources: Sequence[TensorSpec], precision: str, family: str | None, world_size: int) -> OwnedPlan:
        outputs = {src.name: tuple(rollout_specs([src], precision, family)) for src in sources}
        tensors = [spec for out in outputs.values() for spec in out]
        return cls(outputs, assign_owners(tensors, world_size), precision, family)

    def share(self, rank: int) -> int:
        """Bytes of previous bits ``rank`` keeps."""
        return sum(spec.nbytes for out in self.outputs.values() for spec in out if self.owners[spec.name] == rank)


@dataclass(slots=True)
class OwnedBase:
    """One rank's share of the previously published rollout-precision state (tensor name -> bits)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def keep(self, name: str, new: torch.Tensor) -> None:
        """Hold ``new``'s bits as ``name``'s: copied into the tensor already held (no allocation per version,
        so the allocator does not grow the process by freed-and-refilled tensors), else a copy of its own
        (``new`` may be a received buffer, or rank 0's view of a live parameter)."""
        held = self.tensors.get(name)
        if held is not None and held.dtype == new.dtype and held.shape == new.shape:
            held.copy_(new)
        else:
            self.tensors[name] = new.clone()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True, slots=True)
class OwnedTensor:
    """What rank 0 gets per rollout tensor: the tensor (for the state digest, or an anchor's bytes) and, for a
    delta, its record."""

    spec: TensorSpec
    tensor: torch.Tensor
    record: bytes | None


class _Link:
    """Point-to-point transfers between rank 0 and an owner over a gloo group (CPU tensors, any trainer device)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(_as_bytes(tensor), dst=dst, group=self.group)

    def recv_tensor(self, spec: TensorSpec, src: int) -> torch.Tensor:
        buf = torch.empty(spec.nbytes, dtype=torch.uint8)
        dist.recv(buf, src=src, group=self.group)
        return buf.view(spec.dtype).reshape(spec.shape)

    def send_bytes(self, data: bytes, dst: int) -> None:
        dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=self.group)
        if data:
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst, group=self.group)

    def recv_bytes(self, src: int) -> bytes:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=src, group=self.group)
        if not int(size):
            return b""
        buf = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(buf, src=src, group=self.group)
        return buf.numpy().tobytes()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


_link_of: tuple[dist.ProcessGroup, _Link] | None = None


def owner_link() -> _Link | None:
    """The gloo group of the delta exchange, created on first use (collective: every rank calls this at the same
    point, inside :func:`owned_export`); None without a process group (one rank: nothing to exchange)."""
    global _link_of
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if _link_of is None or _link_of[0] is not world:
        _link_of = (world, _Link(dist.new_group(backend="gloo")))
    return _link_of[1]


def owned_export(
    params: Iterable[tuple[str, torch.Tensor]],
    plan: OwnedPlan,
    base: OwnedBase,
    *,
    rank: int,
    anchor: bool,
    level: int = 1,
) -> Iterator[OwnedTensor]:
    """Every trainer rank's part of one delta (or anchor) export; collective, like the export it consumes.

    ``params`` is the backend's export (full float32 tensors on rank 0, empty elsewhere). Rank 0 yields an
    :class:`OwnedTensor` per rollout tensor in the export's order; the other ranks yield nothing but must
    iterate to the end. An anchor (``anchor=True``) produces no records; a delta needs every owner to hold the
    previous bits of its tensors: where one cannot encode its record (no previous bits, or a tensor whose
    dtype or size changed) the record is empty, and rank 0 publishes the version as an anchor instead. Every
    rank goes on to the end either way, so no rank is left waiting in an exchange.
    """
    link = owner_link()
    for name, full in params:
        converted = rollout_tensors(name, full, plan.precision, plan.family) if rank == 0 else {}
        del full
        for spec in plan.outputs[name]:
            owner = plan.owners[spec.name]
            new = converted.pop(spec.name) if rank == 0 else None
            if rank == 0 and (new is None or (new.dtype, tuple(new.shape)) != (spec.dtype, spec.shape)):
                raise ValueError(f"{spec.name}: the export made {None if new is None else (new.dtype, new.shape)}")
            record: bytes | None = None
            if owner == rank:
                if rank != 0:
                    assert link is not None
                    new = link.recv_tensor(spec, src=0)
                assert new is not None
                if not anchor:
                    record = _record(base.tensors.get(spec.name), new, spec.name, level)
                base.keep(spec.name, new)
                if rank != 0 and record is not None:
                    assert link is not None
                    link.send_bytes(record, dst=0)
            elif rank == 0:
                assert link is not None and new is not None
                link.send_tensor(new, dst=owner)
                if not anchor:
                    record = link.recv_bytes(src=owner)
            if rank == 0:
                assert new is not None
                yield OwnedTensor(spec, new, record)
            del new, record


def _record(previous: torch.Tensor | None, new: torch.Tensor, name: str, level: int) -> bytes:
    """``name``'s delta record, or b"" (never a record: those start with a magic) where there is none to make."""
    if previous is None:
        log.warning("owned_delta.no_previous_bits", tensor=name)
        return b""
    try:
        return encode_delta(previous, new, level=level)
    except ValueError as exc:  # the encoder's contract: dtype or size changed, only a full payload will do
        log.warning("owned_delta.encoder_refused", tensor=name, error=str(exc))
        return b""
