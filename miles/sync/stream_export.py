"""Streamed weight export: full tensors one at a time -> a rollout-precision safetensors payload, in pieces.

Gathering the whole state on rank 0, converting it (:func:`miles.sync.precision.to_rollout_state`) and
serialising it (:func:`miles.sync.payload.serialize_state`) before anything reaches the data plane would hold
three copies of the model on one rank. Here nothing larger than one parameter (plus the transport's bucket)
is ever held (every sync mode: delta mode's owners, :mod:`miles.sync.owned_delta`, use the same conversion):

* **Plan up front.** Names, shapes and dtypes of the published tensors follow from the model's parameter
  specs and the precision alone (:func:`rollout_specs`), so the safetensors header, every offset and the
  payload size are known before the first byte of data (:class:`PayloadLayout`).
* **Per-tensor conversion.** :func:`rollout_tensors` is :func:`~miles.sync.precision.to_rollout_state` of a
  one-tensor state: that function converts every tensor independently, so the streamed bits are identical
  to those of the whole-state conversion by construction (and the tests check it).
* **Sorted order.** Tensors are written in byte-wise sorted name order, the order
  :func:`~miles.sync.precision.state_digest` hashes in, so the state digest is computed incrementally
  (:class:`StateHasher`) and equals the whole-state one. The file stays a standard safetensors file (the
  format only needs contiguous data offsets, in any order); with one dtype throughout (bf16, fp32) it is
  byte for byte what ``serialize_state`` writes, since safetensors itself orders by dtype, then name.
  Mixed dtypes (fp8/fp4 codes next to their scales) may leave a tensor at an unaligned offset, which the
  format allows and :func:`~miles.sync.payload.deserialize_state` reads (CPU ``torch.frombuffer``).
* **Incremental digest.** The payload's xxh3-128 is updated with every piece, so it equals what
  :meth:`~miles.sync.transport.dataplane.WeightStore.put` records for the same bytes, without a second pass.

The encoder calls a ``sink`` with each piece (the header, then each tensor's bytes); transports re-bucket
them (:class:`Rechunker`, the data plane's chunk size, a broadcast bucket). Exporting is collective on the
trainer (every rank gathers each parameter), so :func:`encode_payload` always drains its input to the end,
even after a conversion or sink error, which it re-raises afterwards: the other ranks are never left waiting
in a gather rank 0 skipped.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import structlog
import torch
import xxhash

from miles.sync.payload import _DTYPES as SAFETENSORS_DTYPES
from miles.sync.precision import SCALE_SUFFIX, encoding, is_quantized, to_rollout_state

log = structlog.get_logger(__name__)

Sink = Callable[[memoryview], None]
_ST_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_CAST: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
METADATA_KEY = "miles_policy_version"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, dtype and shape of a tensor, known without its data (a DTensor's global shape, say)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(tensor.shape))


def rollout_specs(sources: Iterable[TensorSpec], precision: str, family: str | None = None) -> list[TensorSpec]:
    """The tensors :func:`to_rollout_state` publishes for tensors shaped like ``sources`` (under the model
    ``family``'s quantization rule, if given), sorted by name."""
    is_quantized(precision)  # validates the name
    cast = _CAST.get(precision, torch.bfloat16)
    out: list[TensorSpec] = []
    for src in sources:
        if src.name.endswith(SCALE_SUFFIX):
            raise ValueError(f"{src.name}: a model state dict must not contain '{SCALE_SUFFIX}' names")
        probe = torch.empty(src.shape, dtype=src.dtype, device="meta")
        how = encoding(src.name, probe, precision, family)
        if how is not None:
            (codes_dtype, codes_shape), (scales_dtype, scales_shape) = how.specs(src.shape)
            out += [TensorSpec(src.name, codes_dtype, codes_shape)]
            out += [TensorSpec(src.name + SCALE_SUFFIX, scales_dtype, scales_shape)]
        elif src.dtype.is_floating_point:
            out.append(TensorSpec(src.name, cast, src.shape))
        else:
            out.append(src)
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in the export")
    return sorted(out, key=lambda s: s.name)


def rollout_tensors(
    name: str, tensor: torch.Tensor, precision: str, family: str | None = None
) -> dict[str, torch.Tensor]:
    """One tensor in rollout precision: ``to_rollout_state`` of a one-tensor state (same bits, by construction)."""
    return to_rollout_state({name: tensor}, precision, family)


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes as stored (C order, little-endian), without a copy when it is contiguous on CPU."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


class StateHasher:
    """:func:`miles.sync.precision.state_digest`, fed one tensor at a time in sorted name order."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()
        self._last: str | None = None

    def update(self, name: str, tensor: torch.Tensor, data: memoryview | None = None) -> None:
        """Add ``tensor`` (``data``: its :func:`raw_bytes`, if already at hand). Names must come sorted."""
        if self._last is not None and name <= self._last:
            raise ValueError(f"state digest needs sorted names: {name!r} after {self._last!r}")
        self._last = name
        raw = raw_bytes(tensor) if data is None else data
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        header = f"{name}\0{dtype_name}\0{','.join(map(str, tensor.shape))}\0{raw.nbytes}\n".encode()
        self._h.update(len(header).to_bytes(8, "little"))
        self._h.update(header)
        if raw.nbytes:
            self._h.update(raw)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@dataclass(frozen=True, slots=True)
class PayloadLayout:
    """The safetensors layout of one payload: tensors in data order, the encoded header, the total size."""

    version: int
    precision: str
    tensors: tuple[TensorSpec, ...]
    header: bytes  # 8-byte little-endian length + JSON, space-padded to a multiple of 8 like safetensors
    size: int
    family: str | None = None  # model family whose quantization rule applies (None: the generic rule)
    sha256: bool = False  # also hash the payload with SHA-256 (bus.payload_sha256, docs/security.md)

    @classmethod
    def plan(
        cls,
        sources: Iterable[TensorSpec],
        precision: str,
        version: int,
        family: str | None = None,
        *,
        sha256: bool = False,
    ) -> PayloadLayout:
        """Layout of the rollout-precision payload of ``sources`` (the model's full-tensor specs)."""
        tensors = tuple(rollout_specs(sources, precision, family))
        entries: dict[str, object] = {"__metadata__": {METADATA_KEY: str(version)}}
        offset = 0
        for spec in tensors:
            dtype = _ST_NAMES.get(spec.dtype)
            if dtype is None:
                raise ValueError(f"{spec.name}: dtype {spec.dtype} has no safetensors name")
            shape = list(spec.shape)
            if spec.dtype == torch.float4_e2m1fn_x2:  # F4 counts 4-bit elements: twice torch's last dim
                if not shape:
                    raise ValueError(f"{spec.name}: a 0-d float4_e2m1fn_x2 tensor cannot be stored; give it shape (1,)")
                shape[-1] *= 2
            entries[spec.name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        body = json.dumps(entries, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)
        header = len(body).to_bytes(8, "little") + body
        return cls(
            version=version,
            precision=precision,
            tensors=tensors,
            header=header,
            size=len(header) + offset,
            family=family,
            sha256=sha256,
        )

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.tensors]


@dataclass(frozen=True, slots=True)
class ExportSummary:
    """What a transport announces about an encoded payload."""

    version: int
    size: int
    digest: str  # xxh3-128 of the payload bytes (as WeightStore.put records it)
    state_digest: str  # precision.state_digest of the published tensors
    tensors: int
    payload_sha256: str = ""  # with layout.sha256


class Rechunker:
    """Re-buckets pieces of any size into ``chunk_bytes`` pieces (the last one shorter) for ``emit``.

    Whole chunks inside a piece go out as zero-copy views of it; only chunks that straddle two pieces are
    copied into the one staging buffer, so memory is one chunk whatever the piece sizes.
    """

    def __init__(self, chunk_bytes: int, emit: Sink) -> None:
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be >= 1")
        self.chunk_bytes = chunk_bytes
        self._emit = emit
        self._buf = bytearray(chunk_bytes)
        self._fill = 0
        self.emitted = 0  # bytes passed on

    def write(self, piece: memoryview) -> None:
        view = memoryview(piece)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if self._fill:
            take = min(self.chunk_bytes - self._fill, view.nbytes)
            self._buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill < self.chunk_bytes:
                return
            self._out(memoryview(self._buf))
            self._fill = 0
        while view.nbytes >= self.chunk_bytes:
            self._out(view[: self.chunk_bytes])
            view = view[self.chunk_bytes :]
        if view.nbytes:
            self._buf[: view.nbytes] = view
            self._fill = view.nbytes

    @property
    def written(self) -> int:
        """Bytes taken so far (emitted plus buffered)."""
        return self.emitted + self._fill

    def flush(self) -> None:
        """Emit the last, partial chunk (call once, after the last :meth:`write`)."""
        if self._fill:
            self._out(memoryview(self._buf)[: self._fill])
            self._fill = 0

    def _out(self, chunk: memoryview) -> None:
        self._emit(chunk)
        self.emitted += chunk.nbytes


def iter_rollout_tensors(
    layout: PayloadLayout, params: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """The rollout-precision tensors of ``params`` (full tensors, any order) in ``layout`` order, one at a time.

    A converted tensor is held only until its turn (normally at once: the exporter yields in sorted name order
    too, and a ``.qscale`` sorts right after its codes). Every produced tensor must match the planned name,
    dtype and shape, and every planned tensor must come, else ``ValueError``. Transports that move tensors
    rather than bytes (SGLang's ``/update_weights_from_distributed``) use this directly.
    """
    order = {spec.name: i for i, spec in enumerate(layout.tensors)}
    pending: dict[int, torch.Tensor] = {}
    next_index = 0
    for name, tensor in params:
        converted = rollout_tensors(name, tensor, layout.precision, layout.family)
        del tensor  # the full-precision tensor goes before the exporter gathers the next one
        for out_name in list(converted):
            out = converted.pop(out_name)
            index = order.get(out_name)
            if index is None:
                raise ValueError(f"{out_name}: not in the planned payload (the model changed since the plan?)")
            spec = layout.tensors[index]
            if (out.dtype, tuple(out.shape)) != (spec.dtype, spec.shape):
                raise ValueError(
                    f"{out_name}: produced {out.dtype} {tuple(out.shape)}, planned {spec.dtype} {spec.shape}"
                )
            if index < next_index or index in pending:
                raise ValueError(f"{out_name}: produced twice")
            pending[index] = out
            del out
        while next_index in pending:
            yield layout.tensors[next_index], pending.pop(next_index)
            next_index += 1
    if next_index != len(layout.tensors):
        missing = [spec.name for i, spec in enumerate(layout.tensors) if i >= next_index and i not in pending]
        raise ValueError(f"export ended without {len(missing)} planned tensor(s): {missing[:3]}")


def encode_payload(layout: PayloadLayout, params: Iterable[tuple[str, torch.Tensor]], sink: Sink) -> ExportSummary:
    """Convert ``params`` to ``layout.precision`` and stream the safetensors payload to ``sink``.

    ``sink`` gets the header first, then every tensor's bytes in ``layout`` order (views that are valid
    during the call only: a sink that keeps bytes copies them). On any error (conversion, plan mismatch,
    sink) the rest of ``params`` is drained before the error propagates (see the module docstring).
    """
    source = iter(params)
    try:
        return write_payload(layout, iter_rollout_tensors(layout, source), sink)
    except Exception as exc:
        log.error("stream_export.failed", version=layout.version, error=repr(exc), drained=drain(source))
        raise


def write_payload(
    layout: PayloadLayout, tensors: Iterable[tuple[TensorSpec, torch.Tensor]], sink: Sink
) -> ExportSummary:
    """Stream the safetensors payload of ``tensors``, already in rollout precision and in ``layout`` order, to
    ``sink`` (header first); the summary carries the payload's and the state's digests."""
    payload_hash = xxhash.xxh3_128()
    sha256 = hashlib.sha256() if layout.sha256 else None
    state_hash = StateHasher()
    written = 0

    def emit(piece: memoryview) -> None:
        nonlocal written
        payload_hash.update(piece)
        if sha256 is not None:
            sha256.update(piece)
        sink(piece)
        written += piece.nbytes

    emit(memoryview(layout.header))
    for spec, tensor in tensors:
        data = raw_bytes(tensor)
        state_hash.update(spec.name, tensor, data)
        if data.nbytes:
            emit(data)
        del tensor, data  # before the next tensor is produced: one tensor in memory at a time
    if written != layout.size:
        raise AssertionError(f"wrote {written} bytes, planned {layout.size}")
    return ExportSummary(
        version=layout.version,
        size=written,
        digest=payload_hash.hexdigest(),
        state_digest=state_hash.hexdigest(),
        tensors=len(layout.tensors),
        payload_sha256=sha256.hexdigest() if sha256 is not None else "",
    )


def drain(params: Iterable[object]) -> int:
    """Run an export to the end and drop what it yields: what ranks other than the exporting one do (their
    part of every gather). Returns the number of items."""
    count = 0
    for _ in params:
        count += 1
    return count
