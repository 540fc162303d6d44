"""Sparse delta codec for weight sync in rollout precision (BF16, FP8 e4m3, FP4 e2m1 + block scales).

Between two optimizer steps most rollout-precision weights are bit-identical: an Adam step of
about 1e-6 is below half a BF16 ulp for almost every weight, so only ~2% of BF16 bit patterns
change per step (~0.5% of FP4 codes). slime/Miles-style sync XORs the full tensors and runs zstd
over them, which still spends bits on every unchanged element. This codec sends only *which*
elements changed and *how*, each coded to near its order-0 entropy, then zstd.

Model. Tensors are compared as bit patterns in their own storage dtype: any 1/2/4/8-byte dtype is
viewed as an unsigned integer (bf16 -> uint16, fp8 -> uint8, ...), so NaN payloads, infinities and
``-0.0`` vs ``0.0`` are ordinary distinct patterns and the round trip is bit-exact.
``torch.float4_e2m1fn_x2`` (two FP4 codes per byte, see :mod:`miles.sync.quant`) is compared per
**nibble**: one FP4 element is one position. FP4 block scales are a separate tensor
(``float8_e8m0fnu``, one byte per block) and are delta-coded like any other.

Per tensor, with ``n`` positions of which ``k`` changed (density ``p = k / n``):

* index coding, by density: ``gaps`` (p < 1/16): the gaps between changed positions, LEB128
  varints; ``mask`` (p < 3/4): a bitmap of the positions (``np.packbits``); ``all`` (denser): no
  index, a value for every position (the XOR+zstd scheme, which wins when nearly all changed);
  ``none`` when nothing changed (a ~60-byte record);
* value coding, chosen per tensor by the smallest order-0 entropy on a sample: ``new`` (the new
  patterns), ``xor`` (``new ^ old``) or ``sub`` (the wrap-around integer difference ``new - old``,
  zigzag-coded: a one-ulp step of a float is +-1 in its bit pattern, so this is the usual winner).
  Multi-byte values are split into byte planes (low bytes, high bytes), FP4 values packed two per
  byte;
* each stream (index, each value plane) is compressed with zstd (level 1 by default) and stored
  raw if that is not smaller.

A tensor record carries the xxh3-64 of the base's and of the new tensor's bytes. Applying checks
the base digest first (:class:`DeltaBaseMismatch`: the follower does not hold the tensor the delta
was computed against) and the reconstruction's digest last (:class:`DeltaChecksumMismatch`);
anything malformed raises :class:`DeltaFormatError`. A wrong tensor is never returned.

Tensor record (little endian)::

    b"MDT1" | u8 dtype id | u8 index mode | u8 value mode | u8 stream count
    | u64 positions n | u64 changed k | u64 xxh3-64(base bytes) | u64 xxh3-64(new bytes)
    | per stream: u8 codec (0 raw, 1 zstd) | u64 stored length | u64 raw length
    | stream bytes, in order (index stream first unless the mode is none/all, then value planes)

State record: ``b"MDS1" | u32 header length | JSON header | tensor records``; the header is
``{"format": 1, "base_version", "version", "tensors": [[name, offset, length], ...]}`` with
offsets relative to the end of the header.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch
import xxhash
import zstandard

__all__ = [
    "DeltaError",
    "DeltaBaseMismatch",
    "DeltaChecksumMismatch",
    "DeltaFormatError",
    "encode_delta",
    "apply_delta",
    "encode_state_delta",
    "apply_state_delta",
    "read_state_header",
    "delta_stats",
]


class DeltaError(ValueError):
    """A delta payload that cannot be applied; the caller falls back to a full payload."""


class DeltaBaseMismatch(DeltaError):
    """The delta was computed against another base (version, tensor set or tensor contents)."""


class DeltaChecksumMismatch(DeltaError):
    """The reconstructed tensor's digest differs from the one the encoder recorded."""


class DeltaFormatError(DeltaError):
    """The payload is malformed: truncated, corrupted or of an unknown version."""


_MAGIC_T = b"MDT1"
_MAGIC_S = b"MDS1"
_HEAD = struct.Struct("<4sBBBBQQQQ")
_STREAM = struct.Struct("<BQQ")

# dtype ids are part of the wire format: append only.
_DTYPES: list[torch.dtype] = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float4_e2m1fn_x2,
    torch.float8_e8m0fnu,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
_DTYPE_ID = {dt: i for i, dt in enumerate(_DTYPES)}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_FP4 = torch.float4_e2m1fn_x2

IDX_NONE, IDX_GAPS, IDX_MASK, IDX_ALL = 0, 1, 2, 3
VAL_NEW, VAL_XOR, VAL_SUB = 0, 1, 2
_IDX_NAMES = {IDX_NONE: "none", IDX_GAPS: "gaps", IDX_MASK: "mask", IDX_ALL: "all"}
_VAL_NAMES = {VAL_NEW: "new", VAL_XOR: "xor", VAL_SUB: "sub"}
GAPS_BELOW = 1 / 16
MASK_BELOW = 3 / 4
_SAMPLE = 1 << 16


# --------------------------------------------------------------------------- bit views


def _bits(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer numpy view of a CPU tensor's bytes (a copy only if not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    size = t.element_size()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).numpy().view(_UINT[size])


def _width(dtype: torch.dtype) -> int:
    """Bits per position: 4 for packed FP4, else the element size."""
    return 4 if dtype == _FP4 else torch.empty(0, dtype=dtype).element_size() * 8


def _digest(a: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(a).cast("B")) if a.size else 0


def _nibbles(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.size * 2, dtype=np.uint8)
    out[0::2] = b & 0x0F
    out[1::2] = b >> 4
    return out


def _pack_nibbles(v: np.ndarray) -> np.ndarray:
    if v.size % 2:
        v = np.append(v, np.uint8(0))
    return (v[0::2] | (v[1::2] << 4)).astype(np.uint8)


def _positions(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ascending indices where ``a != b`` and the packed change mask (``np.packbits`` order).

    ``np.flatnonzero`` over the full mask costs ~1 ns per element; packing the mask first (fast) and
    expanding only its non-zero bytes is about twice as fast at the densities of weight deltas."""
    packed = np.packbits(a != b)
    nzb = np.flatnonzero(packed != 0)
    f = np.flatnonzero(np.unpackbits(packed[nzb]).view(bool))  # bool nonzero is the fast path
    return nzb[f >> 3] * 8 + (f & 7), packed


def _changes(a: np.ndarray, b: np.ndarray, fp4: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Changed positions (int64, ascending) with their old and new codes, and the packed change mask
    (``None`` for FP4, whose positions are nibbles)."""
    idx, packed = _positions(a, b)
    if not fp4:
        return idx, a[idx], b[idx], packed
    ai, bi = a[idx], b[idx]
    x = ai ^ bi
    f = np.flatnonzero(np.stack([(x & 0x0F) != 0, (x >> 4) != 0], axis=1).reshape(-1))  # (byte, lo/hi)
    r, c = f >> 1, f & 1
    pos = idx[r] * 2 + c
    sh = (4 * c).astype(np.uint8)
    return pos, (ai[r] >> sh) & 0x0F, (bi[r] >> sh) & 0x0F, None


# --------------------------------------------------------------------------- value transforms


def _signed(dt: np.dtype) -> np.dtype:
    return {np.uint8: np.int8, np.uint16: np.int16, np.uint32: np.int32, np.uint64: np.int64}[dt.type]


def _forward(mode: int, old: np.ndarray, new: np.ndarray, bits: int) -> np.ndarray:
    if mode == VAL_NEW:
        return new
    if mode == VAL_XOR:
        return old ^ new
    if bits == 4:
        d = (new.astype(np.int16) - old.astype(np.int16)) & 0x0F
        s = np.where(d >= 8, d - 16, d)
        return np.where(s >= 0, 2 * s, -2 * s - 1).astype(np.uint8)
    s = (new - old).view(_signed(new.dtype))  # wrap-around difference
    return ((s << 1) ^ (s >> (bits - 1))).view(new.dtype)  # zigzag


def _inverse(mode: int, old: np.ndarray, v: np.ndarray, bits: int) -> np.ndarray:
    if mode == VAL_NEW:
        return v
    if mode == VAL_XOR:
        return old ^ v
    if bits == 4:
        z = v.astype(np.int16)
        s = (z >> 1) ^ -(z & 1)
        return ((old.astype(np.int16) + s) & 0x0F).astype(np.uint8)
    one = v.dtype.type(1)
    d = (v >> one) ^ (np.zeros_like(v) - (v & one))  # un-zigzag, still as wrap-around unsigned
    return old + d


def _planes(v: np.ndarray, bits: int) -> list[np.ndarray]:
    if bits == 4:
        return [_pack_nibbles(v)]
    if bits == 8:
        return [v]
    by = v.view(np.uint8).reshape(-1, bits // 8)
    return [np.ascontiguousarray(by[:, j]) for j in range(bits // 8)]


def _unplanes(planes: list[np.ndarray], count: int, bits: int, dt: type) -> np.ndarray:
    if bits == 4:
        return _nibbles(planes[0])[:count]
    if bits == 8:
        return planes[0]
    return np.stack(planes, axis=1).reshape(-1).view(dt)


def _plane_lengths(count: int, bits: int) -> list[int]:
    if bits == 4:
        return [(count + 1) // 2]
    return [count] * (bits // 8)


def _entropy_bits(symbols: np.ndarray, nsym: int) -> float:
    if symbols.size == 0:
        return 0.0
    c = np.bincount(symbols.astype(np.int64), minlength=nsym)
    pr = c[c > 0] / symbols.size
    return float(-(pr * np.log2(pr)).sum() * symbols.size)


def _choose_value_mode(old: np.ndarray, new: np.ndarray, bits: int) -> int:
    if old.size > _SAMPLE:
        sel = np.linspace(0, old.size - 1, _SAMPLE).astype(np.int64)
        old, new = old[sel], new[sel]
    best, best_cost = VAL_NEW, float("inf")
    for mode in (VAL_SUB, VAL_XOR, VAL_NEW):
        v = _forward(mode, old, new, bits)
        if bits == 4:
            cost = _entropy_bits(v, 16)
        else:
            by = v.view(np.uint8).reshape(-1, bits // 8)
            cost = sum(_entropy_bits(by[:, j], 256) for j in range(bits // 8))
        if cost < best_cost:
            best, best_cost = mode, cost
    return best


# --------------------------------------------------------------------------- index coding


def _varint_encode(g: np.ndarray) -> np.ndarray:
    """LEB128 of non-negative int64 integers, vectorised (one pass per 7-bit group)."""
    if g.size == 0:
        return np.zeros(0, dtype=np.uint8)
    levels = max(1, -(-int(g.max()).bit_length() // 7))
    if levels == 1:
        return g.astype(np.uint8)
    nb = np.ones(g.size, dtype=np.int64)
    for j in range(1, levels):
        nb += g >= (1 << (7 * j))
    starts = np.cumsum(nb) - nb
    out = np.empty(int(starts[-1] + nb[-1]), dtype=np.uint8)
    out[starts] = (g & 0x7F).astype(np.uint8) | ((nb > 1).astype(np.uint8) << 7)
    for j in range(1, levels):
        sel = np.flatnonzero(nb > j)
        out[starts[sel] + j] = ((g[sel] >> (7 * j)) & 0x7F).astype(np.uint8) | ((nb[sel] > j + 1).astype(np.uint8) << 7)
    return out


def _varint_decode(buf: np.ndarray) -> np.ndarray:
    if buf.size == 0:
        return np.zeros(0, dtype=np.uint64)
    ends = np.flatnonzero(buf < 0x80)
    if ends.size == 0 or ends[-1] != buf.size - 1:
        raise DeltaFormatError("truncated varint stream")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    nb = ends - starts + 1
    if nb.max() > 9:
        raise DeltaFormatError("varint longer than 63 bits")
    g = (buf[starts] & 0x7F).astype(np.uint64)
    for j in range(1, int(nb.max())):
        sel = np.flatnonzero(nb > j)
        g[sel] |= (buf[starts[sel] + j] & 0x7F).astype(np.uint64) << np.uint64(7 * j)
    return g


# --------------------------------------------------------------------------- streams


def _pack_stream(arr: np.ndarray, level: int) -> tuple[bytes, bytes]:
    raw = arr.tobytes()
    if raw:
        comp = zstandard.ZstdCompressor(level=level).compress(raw)
        if len(comp) < len(raw):
            return _STREAM.pack(1, len(comp), len(raw)), comp
    return _STREAM.pack(0, len(raw), len(raw)), raw


def encode_delta(prev: torch.Tensor, new: torch.Tensor, *, level: int = 1) -> bytes:
    """Delta record turning ``prev`` into ``new`` (same dtype and number of elements, CPU or not)."""
    if prev.dtype != new.dtype:
        raise ValueError(f"dtype changed: {prev.dtype} -> {new.dtype}")
    if prev.numel() != new.numel():
        raise ValueError(f"numel changed: {prev.numel()} -> {new.numel()}")
    if prev.dtype not in _DTYPE_ID:
        raise ValueError(f"unsupported dtype {prev.dtype}")
    bits = _width(prev.dtype)
    fp4 = bits == 4
    a, b = _bits(prev), _bits(new)
    n = a.size * 2 if fp4 else a.size
    idx, old, nv, packed = _changes(a, b, fp4)
    k = idx.size
    if k == 0:
        imode, vmode, streams = IDX_NONE, VAL_NEW, []
    else:
        p = k / n
        imode = IDX_GAPS if p < GAPS_BELOW else IDX_MASK if p < MASK_BELOW else IDX_ALL
        if imode == IDX_ALL:
            old, nv = (_nibbles(a), _nibbles(b)) if fp4 else (a, b)
        vmode = _choose_value_mode(old, nv, bits)
        streams = []
        if imode == IDX_GAPS:
            gaps = np.diff(idx, prepend=-1) - 1
            streams.append(_varint_encode(gaps))
        elif imode == IDX_MASK:
            if packed is None:
                mask = np.zeros(n, dtype=bool)
                mask[idx] = True
                packed = np.packbits(mask)
            streams.append(packed)
        streams.extend(_planes(_forward(vmode, old, nv, bits), bits))
    heads, bodies = [], []
    for s in streams:
        h, body = _pack_stream(s, level)
        heads.append(h)
        bodies.append(body)
    head = _HEAD.pack(_MAGIC_T, _DTYPE_ID[prev.dtype], imode, vmode, len(streams), n, k, _digest(a), _digest(b))
    return b"".join([head, *heads, *bodies])


def _parse(payload: memoryview) -> tuple[tuple, list[np.ndarray]]:
    if len(payload) < _HEAD.size:
        raise DeltaFormatError(f"tensor record of {len(payload)} bytes is shorter than its header")
    head = _HEAD.unpack_from(payload, 0)
    magic, dtype_id, imode, vmode, nstreams, n, k, _, _ = head
    if magic != _MAGIC_T:
        raise DeltaFormatError(f"bad tensor record magic {bytes(magic)!r}")
    if dtype_id >= len(_DTYPES) or imode not in _IDX_NAMES or vmode not in _VAL_NAMES or k > n:
        raise DeltaFormatError("bad tensor record header")
    bits = _width(_DTYPES[dtype_id])
    vplanes = _plane_lengths(n if imode == IDX_ALL else k, bits)
    expect = {IDX_NONE: 0, IDX_GAPS: 1 + len(vplanes), IDX_MASK: 1 + len(vplanes), IDX_ALL: len(vplanes)}[imode]
    if nstreams != expect or (imode == IDX_NONE) != (k == 0):
        raise DeltaFormatError(f"tensor record has {nstreams} streams for index mode {_IDX_NAMES[imode]}")
    limits = {IDX_GAPS: [10 * k], IDX_MASK: [(n + 7) // 8]}.get(imode, []) + vplanes
    pos = _HEAD.size + nstreams * _STREAM.size
    if len(payload) < pos:
        raise DeltaFormatError("truncated stream table")
    streams = []
    for i in range(nstreams):
        codec, stored, raw_len = _STREAM.unpack_from(payload, _HEAD.size + i * _STREAM.size)
        exact = i > 0 or imode == IDX_ALL or imode == IDX_MASK
        if codec > 1 or raw_len > limits[i] or (exact and raw_len != limits[i]) or pos + stored > len(payload):
            raise DeltaFormatError(f"stream {i}: bad or truncated (codec {codec}, {stored}/{raw_len} bytes)")
        body = payload[pos : pos + stored]
        pos += stored
        if codec == 1:
            try:
                data = zstandard.ZstdDecompressor().decompress(body, max_output_size=raw_len)
            except zstandard.ZstdError as exc:
                raise DeltaFormatError(f"stream {i}: {exc}") from None
        else:
            data = body
        if len(data) != raw_len:
            raise DeltaFormatError(f"stream {i}: {len(data)} bytes, expected {raw_len}")
        streams.append(np.frombuffer(data, dtype=np.uint8))
    if pos != len(payload):
        raise DeltaFormatError(f"{len(payload) - pos} trailing bytes after the tensor record")
    return head, streams


def apply_delta(prev: torch.Tensor, payload: bytes | bytearray | memoryview) -> torch.Tensor:
    """``prev`` + delta record -> the new tensor (a fresh CPU tensor shaped like ``prev``); ``prev``
    is not modified. Raises :class:`DeltaError` rather than ever returning a wrong tensor."""
    head, streams = _parse(memoryview(payload).cast("B"))
    _, dtype_id, imode, vmode, _, n, k, base_digest, new_digest = head
    dtype = _DTYPES[dtype_id]
    if prev.dtype != dtype:
        raise DeltaBaseMismatch(f"delta is for {dtype}, base tensor is {prev.dtype}")
    bits = _width(dtype)
    fp4 = bits == 4
    a = _bits(prev)
    if (a.size * 2 if fp4 else a.size) != n:
        raise DeltaBaseMismatch(f"delta is for {n} positions, base tensor has {prev.numel()} elements")
    if _digest(a) != base_digest:
        raise DeltaBaseMismatch("base tensor contents differ from the delta's base (digest mismatch)")
    out = a.copy()
    try:
        if imode == IDX_ALL:
            old = _nibbles(a) if fp4 else a
            v = _unplanes(streams, n, bits, a.dtype)
            newv = _inverse(vmode, old, v, bits)
            out = _pack_nibbles(newv) if fp4 else newv
        elif imode != IDX_NONE:
            if imode == IDX_GAPS:
                g = _varint_decode(streams[0])
                if g.size != k or (k and int(g.max()) >= n):
                    raise DeltaFormatError(f"gap stream holds {g.size} gaps, expected {k}")
                idx = np.cumsum(g.astype(np.int64) + 1) - 1
            else:
                mask = np.unpackbits(streams[0], count=n).view(bool)
                idx = np.flatnonzero(mask)
            if idx.size != k or (k and (idx[-1] >= n or idx[0] < 0)):
                raise DeltaFormatError("changed positions out of range")
            v = _unplanes(streams[1:], k, bits, a.dtype)
            if fp4:
                byte, hi = idx >> 1, (idx & 1).astype(np.uint8)
                old = (a[byte] >> (4 * hi)) & 0x0F
                newv = _inverse(vmode, old, v, bits)
                lo_sel, hi_sel = hi == 0, hi == 1
                bl, bh = byte[lo_sel], byte[hi_sel]
                out[bl] = (out[bl] & 0xF0) | newv[lo_sel]
                out[bh] = (out[bh] & 0x0F) | (newv[hi_sel] << 4)
            else:
                out[idx] = _inverse(vmode, a[idx], v, bits)
    except (ValueError, IndexError, OverflowError) as exc:
        if isinstance(exc, DeltaError):
            raise
        raise DeltaFormatError(f"cannot decode the tensor record: {exc}") from None
    if not out.flags.writeable:
        out = out.copy()
    if _digest(out) != new_digest:
        raise DeltaChecksumMismatch("reconstructed tensor's digest differs from the encoder's")
    size = torch.empty(0, dtype=dtype).element_size()
    tout = torch.from_numpy(out.view({1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[size]))
    return tout.view(dtype).reshape(prev.shape)


def delta_stats(payload: bytes | bytearray | memoryview) -> dict:
    """What a tensor record chose: index and value mode, positions, changed, stream sizes."""
    head, _ = _parse(memoryview(payload).cast("B"))
    _, dtype_id, imode, vmode, nstreams, n, k, _, _ = head
    sizes = [_STREAM.unpack_from(payload, _HEAD.size + i * _STREAM.size)[1] for i in range(nstreams)]
    return {
        "dtype": str(_DTYPES[dtype_id]).removeprefix("torch."),
        "index": _IDX_NAMES[imode],
        "values": _VAL_NAMES[vmode],
        "positions": n,
        "changed": k,
        "stream_bytes": sizes,
        "bytes": len(payload),
    }


# --------------------------------------------------------------------------- state level


def encode_state_delta(
    prev_state: dict[str, torch.Tensor],
    new_state: dict[str, torch.Tensor],
    base_version: int,
    version: int,
    *,
    level: int = 1,
) -> bytes:
    """Delta of a whole weight set from ``base_version`` to ``version``. Both states must hold the
    same names, dtypes and element counts (otherwise ``ValueError``: publish a full payload)."""
    if set(prev_state) != set(new_state):
        raise ValueError(f"tensor set changed: {sorted(set(prev_state) ^ set(new_state))[:5]}")
    records, entries, off = [], [], 0
    for name, new in new_state.items():
        rec = encode_delta(prev_state[name], new, level=level)
        records.append(rec)
        entries.append([name, off, len(rec)])
        off += len(rec)
    header = json.dumps(
        {"format": 1, "base_version": int(base_version), "version": int(version), "tensors": entries},
        separators=(",", ":"),
    ).encode()
    return b"".join([_MAGIC_S, struct.pack("<I", len(header)), header, *records])


def read_state_header(payload: bytes | bytearray | memoryview) -> dict:
    """The state record's JSON header (``base_version``, ``version``, ``tensors``), validated."""
    buf = memoryview(payload).cast("B")
    if len(buf) < 8 or bytes(buf[:4]) != _MAGIC_S:
        raise DeltaFormatError("not a state delta (bad magic or too short)")
    (hlen,) = struct.unpack_from("<I", buf, 4)
    if 8 + hlen > len(buf):
        raise DeltaFormatError(f"header length {hlen} exceeds payload size {len(buf)}")
    try:
        header = json.loads(bytes(buf[8 : 8 + hlen]))
        ok = header["format"] == 1 and isinstance(header["base_version"], int) and isinstance(header["version"], int)
        body = len(buf) - 8 - hlen
        end = 0
        for name, start, length in header["tensors"]:
            ok = ok and isinstance(name, str) and start == end and length >= 0
            end = start + length
        ok = ok and end == body
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise DeltaFormatError(f"bad state delta header: {exc}") from None
    if not ok:
        raise DeltaFormatError("state delta header does not describe its body")
    header["_body"] = 8 + hlen
    return header


def apply_state_delta(
    prev_state: dict[str, torch.Tensor], payload: bytes | bytearray | memoryview, base_version: int
) -> dict[str, torch.Tensor]:
    """``prev_state`` (which is ``base_version``) + state delta -> the new state (fresh tensors).

    Raises :class:`DeltaBaseMismatch` if the delta was computed from another version, tensor set or
    tensor contents, :class:`DeltaChecksumMismatch` / :class:`DeltaFormatError` if it is damaged.
    """
    header = read_state_header(payload)
    if header["base_version"] != base_version:
        raise DeltaBaseMismatch(f"delta is from version {header['base_version']}, the base held is {base_version}")
    names = [e[0] for e in header["tensors"]]
    if set(names) != set(prev_state) or len(names) != len(prev_state):
        raise DeltaBaseMismatch("delta's tensor set differs from the base's")
    buf = memoryview(payload).cast("B")
    body = header["_body"]
    out = {}
    for name, start, length in header["tensors"]:
        try:
            out[name] = apply_delta(prev_state[name], buf[body + start : body + start + length])
        except DeltaError as exc:
            raise type(exc)(f"{name}: {exc}") from None
    return out
