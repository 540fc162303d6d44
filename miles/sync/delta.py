"""Sparse delta codec for weight sync in rollout precision (BF16, FP8 e4m3, FP4 e2m1 + block scales).

Between two optimizer steps most rollout-precision weights are bit-identical: an Adam step of
about 1e-6 is below half a BF16 ulp for almost every weight, so only ~2% of BF16 bit patterns
change per step (~0.5% of FP4 codes). slime/Miles-style sync XORs the full tensors and runs zstd
over them, which still spends bits on every unchanged element. This codec sends only *which*
elements changed and *how*: close to their order-0 entropy, and for floats below it.

Model. Tensors are compared as bit patterns in their own storage dtype: any 1/2/4/8-byte dtype is
viewed as an unsigned integer (bf16 -> uint16, fp8 -> uint8, ...), so NaN payloads, infinities and
``-0.0`` vs ``0.0`` are ordinary distinct patterns and the round trip is bit-exact.
``torch.float4_e2m1fn_x2`` (two FP4 codes per byte, see :mod:`miles.sync.quant`) is compared per
**nibble**: one FP4 element is one position. FP4 block scales are a separate tensor
(``float8_e8m0fnu``, one byte per block) and are delta-coded like any other.

Per tensor, with ``n`` positions of which ``k`` changed (density ``p = k / n``), the index mode is
``none`` (nothing changed: a ~30-byte record), ``gaps`` (p < 3/4) or ``all`` (a value for every
position: the XOR+zstd scheme, which wins when nearly everything changed). Format 1's bitmap mode
(for 1/16 <= p < 3/4) is gone: gap coding with a small Rice parameter and the magnitude classes
below is 20-30% smaller at those densities too.

``gaps`` (the weight-delta case) codes, per change, the gap to the previous change and the value:

* **Magnitude classes.** A weight moves by about ``lr`` whatever its size, but the rounding grid
  (one ulp) scales with the magnitude, so small weights change far more often: for BF16 the chance
  to change halves with every binade, and the few weights near zero change at nearly every step.
  For float dtypes the encoder may set apart the *small* class ``(base & ~sign) < T`` (``T`` on a
  binade boundary, typically ~2% of the positions holding ~half of the changes) and code its
  changes as gaps in the class's own rank order (the decoder knows the base, so it recomputes the
  class), and the rest's as gaps over all positions (which costs only ``log2(n / n_rest)`` bits per
  change and needs no select on the decoder side). ``T`` minimises ``n_s H(k_s / n_s) + n H(k_r /
  n)`` on contiguous samples spread over the tensor, and the split is dropped if the exact counts
  do not confirm a gain. For weight deltas this saves ~1.5-2.5 bits per change against the order-0
  bound ``n H(p)``. Small-class ranks come from a popcount prefix over 64-bit words of the class
  bitmap.
* **Gaps** ``g`` (positions skipped) are Rice-split with a per-class ``r`` (mean quotient ~6): the
  low ``r`` bits are stored raw as bit planes and the quotient ``q = g >> r`` goes into a symbol byte.
* **Values** ``v``: ``sub`` (zigzag of the wrap-around difference ``new - old``: a one-ulp step is
  +-1 in the bit pattern; always used for floats), ``xor``, ``new``, or for FP4 ``rank``: the rank
  of the new code among the codes that followed the same old code, by frequency in this tensor (a
  16x16 table of nibbles is sent), which captures e.g. that +0 only moves to 0.5 or to -0.
* Each change becomes one **symbol byte** ``J = min(q, 31) << 3 | min(v', 7)`` (``v' = v - 1`` for
  xor/sub, whose values are never 0); quotients >= 31 and values >= 7 are escapes, sent as LEB128
  varints in two escape streams. ``J`` carries the sign of the step and the coarse gap jointly, so
  zstd's order-0 Huffman coder gets several bits per symbol and stays close to their entropy.

``all`` sends the value planes of the chosen transform (``new``, ``xor`` or ``sub``; two byte planes
for 16-bit values, FP4 values packed two per byte). Every stream except the raw Rice bits
is compressed with zstd (level 1 by default) and stored raw if that is not smaller.

Speed (numpy only, one core): one pass over both tensors in L2-sized chunks hashes each chunk, then
compares it as 64-bit words and tests the small class while it is in cache; the changed words are
then gathered and looked into, so per-element work is a handful of vectorised operations and
everything else is proportional to the number of changes. The xxh3 of ``new`` is remembered for the
tensor object (keyed by storage pointer and torch version counter): encoding the next version against
it, as the publisher does, skips hashing the base again.

A tensor record carries the xxh3-64 of the base's and of the new tensor's bytes. A reconstruction
is returned only if its digest matches the new one (:class:`DeltaChecksumMismatch` otherwise); when
decoding fails, the base digest tells a base the delta was not computed against
(:class:`DeltaBaseMismatch`, checked first) from a damaged record (:class:`DeltaFormatError` /
:class:`DeltaChecksumMismatch`). A wrong tensor is never returned.

Tensor record (little endian; ``uv`` = unsigned LEB128 varint)::

    b"MDT2" | u8 dtype id | u8 index mode | u8 value mode | u8 stream count
    | u64 xxh3-64(base bytes) | u64 xxh3-64(new bytes) | uv positions n | uv changed k
    | params, gaps only: uv T (0: no split) | per class (1, or 2: [small, rest]): uv r, uv k_c
    | per stream: u8 codec (0 raw, 1 zstd) | uv stored length | uv raw length (zstd only)
    | stream bytes, in order

Streams: ``gaps``: [rank table (FP4 ``rank`` only, 128 B)] then per class: symbols ``J`` (``k_c``
bytes), Rice low bits (``r // 8`` whole low bytes per change, then one ``ceil(k_c / 8)``-byte LSB-first
bit plane per remaining bit), quotient escapes, value escapes; the small class's gaps count
small-class positions, the rest's all positions. ``all``: the value planes.

State record (format 3, written as it is encoded: the header names the tensors, each record carries its
own length, so no offset has to be known before the last record is)::

    b"MDS3" | u32 header length | JSON {"format": 3, "base_version", "version", "tensors": [name, ...]}
    | per tensor, in the header's order: u64 record length | tensor record

The trainer encodes each tensor's record on the rank that keeps that tensor's previous bits and streams the
records into the data plane one at a time (:mod:`miles.sync.owned_delta`); :func:`encode_state_delta` is
the same for a whole state held in one place.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import weakref

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
    "state_delta_header",
    "framed_record",
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


_MAGIC_T = b"MDT2"
_MAGIC_S = b"MDS3"
_FORMAT = 3
_RECORD_LEN = struct.Struct("<Q")
_HEAD = struct.Struct("<4sBBBBQQ")

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
_SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_FP4 = torch.float4_e2m1fn_x2
# sign-magnitude float layouts, for the magnitude classes: dtype -> (magnitude mask, mantissa bits)
_FLOAT_LAYOUT = {
    torch.bfloat16: (0x7FFF, 7),
    torch.float16: (0x7FFF, 10),
    torch.float32: (0x7FFF_FFFF, 23),
    torch.float64: (0x7FFF_FFFF_FFFF_FFFF, 52),
    torch.float8_e4m3fn: (0x7F, 3),
    torch.float8_e5m2: (0x7F, 2),
}

IDX_NONE, IDX_GAPS, IDX_ALL = 0, 1, 3  # 2 was format 1's bitmap mode: gaps codes those densities better
VAL_NEW, VAL_XOR, VAL_SUB, VAL_RANK = 0, 1, 2, 3
_IDX_NAMES = {IDX_NONE: "none", IDX_GAPS: "gaps", IDX_ALL: "all"}
_VAL_NAMES = {VAL_NEW: "new", VAL_XOR: "xor", VAL_SUB: "sub", VAL_RANK: "rank"}
GAPS_BELOW = 3 / 4
_SAMPLE = 1 << 14  # values sampled to choose a value transform
_ZV, _QC = 8, 32  # symbol byte J = q' * _ZV + v': 7 direct values + escape, 31 direct quotients + escape
_RANK_MIN_K = 2048  # FP4 rank tables (128 B) pay off from about this many changes
_SPLIT_MIN_K = 256  # magnitude classes: never for tensors of fewer positions
_SPLIT_GAIN = 0.97  # ... nor unless the estimated index cost drops by 3%
_CHUNK_BYTES = 1 << 18  # full-tensor passes run in chunks of this many bytes per operand (L2-resident)


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


_tls = threading.local()


def _zc(level: int) -> zstandard.ZstdCompressor:
    cache = _tls.__dict__.setdefault("zc", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _zd() -> zstandard.ZstdDecompressor:
    if not hasattr(_tls, "zd"):
        _tls.zd = zstandard.ZstdDecompressor()
    return _tls.zd


# --------------------------------------------------------------------------- full-tensor passes


def _chunk(a: np.ndarray) -> int:
    return max(64, (_CHUNK_BYTES // a.itemsize) & ~63)


def _small_bitmap(a: np.ndarray, mag: int, t: int) -> np.ndarray:
    """Bitmap (LSB first) of ``(a & mag) < t`` (the small-magnitude class), padded to 64-bit words."""
    n = a.size
    out = np.zeros(-(-n // 64) * 8, dtype=np.uint8)
    step = _chunk(a)
    tmp = np.empty(min(n, step), dtype=a.dtype)
    buf = np.empty(min(n, step), dtype=bool)
    for s in range(0, n, step):
        e = min(n, s + step)
        x, m = tmp[: e - s], buf[: e - s]
        np.bitwise_and(a[s:e], mag, out=x)
        np.less(x, t, out=m)
        out[s >> 3 : (e + 7) >> 3] = np.packbits(m, bitorder="little")
    return out


def _set_bits(pk: np.ndarray) -> np.ndarray:
    """Ascending int64 indices of the set bits of an LSB-first bitmap.

    ``flatnonzero`` costs about 1 ns per element it scans; scanning the bytes first and then only
    the bits of the non-zero bytes is several times cheaper at the densities of weight deltas.
    (``np.take`` is used throughout: it is 2x faster than fancy indexing for these gathers.)"""
    nzb = np.flatnonzero(pk != 0)
    f = np.flatnonzero(np.unpackbits(np.take(pk, nzb), bitorder="little").view(bool))
    return (np.take(nzb, f >> 3) << 3) | (f & 7)


def _cumsum(x: np.ndarray) -> np.ndarray:
    """Inclusive int64 prefix sum (torch's kernel is ~4x faster than numpy's on one core)."""
    return torch.cumsum(torch.from_numpy(x), 0, dtype=torch.int64).numpy()


def _rank(words: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """For a bitmap as uint64 words: how many set bits precede each of ``pos``."""
    cum = _cumsum(np.bitwise_count(words))
    wi = pos >> 6
    above = np.take(words, wi) >> np.bitwise_and(pos, 63).view(np.uint64)  # bits at and after each position
    return np.take(cum, wi) - np.bitwise_count(above)


# --------------------------------------------------------------------------- value transforms


def _forward(mode: int, old: np.ndarray, new: np.ndarray, bits: int) -> np.ndarray:
    if mode == VAL_NEW:
        return new
    if mode == VAL_XOR:
        return old ^ new
    if bits == 4:
        d = (new.astype(np.int16) - old.astype(np.int16)) & 0x0F
        s = np.where(d >= 8, d - 16, d)
        return np.where(s >= 0, 2 * s, -2 * s - 1).astype(np.uint8)
    s = (new - old).view(_SINT[bits // 8])  # wrap-around difference
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


def _sample(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if old.size > _SAMPLE:
        sel = np.linspace(0, old.size - 1, _SAMPLE).astype(np.int64)
        return old[sel], new[sel]
    return old, new


def _choose_plane_mode(old: np.ndarray, new: np.ndarray, bits: int) -> int:
    """all mode: the transform whose byte planes have the smallest order-0 entropy (on a sample)."""
    old, new = _sample(old, new)
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


def _symbol_cost(v: np.ndarray, base: int) -> float:
    """Approximate bits of values ``v`` (>= ``base``) as J's value part plus varint escapes."""
    s = v.astype(np.uint64) - np.uint64(base)
    esc = s >= _ZV - 1
    cost = _entropy_bits(np.minimum(s, _ZV - 1), _ZV)
    if esc.any():
        e = s[esc] - np.uint64(_ZV - 1)
        nbytes = e.size + sum(int(np.count_nonzero(e >> np.uint64(7 * j))) for j in range(1, 10))
        cost += 8 * nbytes * 0.8  # zstd squeezes the escape varints a little
    return cost


def _choose_symbol_mode(old: np.ndarray, new: np.ndarray, bits: int) -> int:
    """gaps mode, non-FP4: the transform whose values cost least as symbol-byte values (on a sample)."""
    old, new = _sample(old, new)
    costs = {m: _symbol_cost(_forward(m, old, new, bits), 0 if m == VAL_NEW else 1) for m in (VAL_SUB, VAL_XOR)}
    costs[VAL_NEW] = _symbol_cost(new, 0)
    return min(costs, key=costs.__getitem__)


# --------------------------------------------------------------------------- varints and bit fields


def _varint_encode(g: np.ndarray) -> np.ndarray:
    """LEB128 of non-negative integers (any integer dtype, up to 64 bits), vectorised."""
    if g.size == 0:
        return np.zeros(0, dtype=np.uint8)
    g = g.astype(np.uint64, copy=False)
    levels = max(1, -(-int(g.max()).bit_length() // 7))
    if levels == 1:
        return g.astype(np.uint8)
    nb = np.ones(g.size, dtype=np.int64)
    for j in range(1, levels):
        nb += g >= np.uint64(1 << (7 * j))
    starts = np.cumsum(nb) - nb
    out = np.empty(int(starts[-1] + nb[-1]), dtype=np.uint8)
    out[starts] = (g & np.uint64(0x7F)).astype(np.uint8) | ((nb > 1).astype(np.uint8) << 7)
    for j in range(1, levels):
        sel = np.flatnonzero(nb > j)
        byte = ((g[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        out[starts[sel] + j] = byte | ((nb[sel] > j + 1).astype(np.uint8) << 7)
    return out


def _varint_decode(buf: np.ndarray, count: int) -> np.ndarray:
    """Exactly ``count`` LEB128 integers filling ``buf`` (uint64), else :class:`DeltaFormatError`."""
    if buf.size == 0:
        if count:
            raise DeltaFormatError("empty varint stream")
        return np.zeros(0, dtype=np.uint64)
    ends = np.flatnonzero(buf < 0x80)
    if ends.size != count or ends[-1] != buf.size - 1:
        raise DeltaFormatError(f"varint stream holds {ends.size} values, expected {count}")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    nb = ends - starts + 1
    if nb.max() > 10 or (nb.max() == 10 and int(buf[ends[nb == 10]].max()) > 1):
        raise DeltaFormatError("varint longer than 64 bits")
    g = (buf[starts] & 0x7F).astype(np.uint64)
    for j in range(1, int(nb.max())):
        sel = np.flatnonzero(nb > j)
        g[sel] |= (buf[starts[sel] + j] & 0x7F).astype(np.uint64) << np.uint64(7 * j)
    return g


def _pack_bits(v: np.ndarray, r: int) -> np.ndarray:
    """The low ``r`` bits of each of ``v`` (non-negative): whole low bytes while ``r >= 8``, then
    one bit plane (``ceil(count / 8)`` bytes, LSB first) per remaining bit."""
    if r == 0 or v.size == 0:
        return np.zeros(0, dtype=np.uint8)
    parts = []
    while r >= 8:
        parts.append((v & 0xFF).astype(np.uint8))
        v, r = v >> 8, r - 8
    v8 = v.astype(np.uint8)
    parts += [np.packbits(v8 & np.uint8(1 << j), bitorder="little") for j in range(r)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _packed_bits_len(count: int, r: int) -> int:
    return (r // 8) * count + (r % 8) * -(-count // 8)


def _unpack_bits(buf: np.ndarray, count: int, r: int) -> np.ndarray:
    """Inverse of :func:`_pack_bits`: ``count`` int64 values of ``r`` bits."""
    out = np.zeros(count, dtype=np.int64)
    if r == 0 or count == 0:
        return out
    pos = shift = 0
    while r - shift >= 8:
        out |= buf[pos : pos + count].astype(np.int64) << shift
        pos, shift = pos + count, shift + 8
    plane = -(-count // 8)
    acc = np.zeros(count, dtype=np.uint8)
    for j in range(r - shift):
        bits = np.unpackbits(buf[pos : pos + plane], count=count, bitorder="little")
        acc |= bits << np.uint8(j)
        pos += plane
    out |= acc.astype(np.int64) << shift
    return out


# --------------------------------------------------------------------------- record framing


def _uv(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_uv(buf: memoryview, pos: int) -> tuple[int, int]:
    x = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DeltaFormatError("truncated or overlong varint in the record header")
        b = buf[pos]
        pos += 1
        x |= (b & 0x7F) << shift
        if b < 0x80:
            return x, pos
        shift += 7


def _record(
    dtype: torch.dtype,
    imode: int,
    vmode: int,
    n: int,
    k: int,
    digests: tuple[int, int],
    params: list[int],
    streams: list[tuple[np.ndarray, bool]],
    level: int,
) -> bytes:
    """Frame a tensor record; ``streams`` are (bytes, compress?) pairs."""
    table, bodies = [], []
    for arr, compress in streams:
        raw = memoryview(np.ascontiguousarray(arr)).cast("B")
        body, codec = raw, 0
        if compress and len(raw) > 32:
            comp = _zc(level).compress(raw)
            if len(comp) < len(raw):
                body, codec = comp, 1
        table.append(bytes([codec]) + _uv(len(body)) + (_uv(len(raw)) if codec else b""))
        bodies.append(body)
    head = _HEAD.pack(_MAGIC_T, _DTYPE_ID[dtype], imode, vmode, len(streams), *digests)
    return b"".join([head, *(_uv(p) for p in [n, k, *params]), *table, *bodies])


# --------------------------------------------------------------------------- encoder


def _scan(
    a: np.ndarray, b: np.ndarray, small: tuple[int, int] | None, digest_a: int | None
) -> tuple[int, int, np.ndarray, np.ndarray | None]:
    """One pass over ``a`` and ``b`` in L2-sized chunks: the xxh3-64 of both (``a``'s skipped if
    known), the bitmap of the 64-bit words that differ and, with ``small = (mag, t)``, the per-element
    bitmap of ``(a & mag) < t``. A trailing part shorter than a word is compared by the caller.

    Hashing a chunk pulls it into the cache, so the compare and the class test run from L2 (each
    tensor is read from memory once), and comparing whole words is several times cheaper than
    comparing elements and packing a bit per element."""
    n, lanes = a.size, 8 // a.itemsize
    nw = a.nbytes // 8
    wa, wb = a[: nw * lanes].view(np.uint64), b[: nw * lanes].view(np.uint64)
    ne = np.zeros(-(-nw // 64) * 8, dtype=np.uint8)
    sm = np.zeros(-(-n // 64) * 8, dtype=np.uint8) if small else None
    ha = xxhash.xxh3_64() if digest_a is None else None
    hb = xxhash.xxh3_64()
    step = max(64, _CHUNK_BYTES // 8)  # words: a multiple of 8, so bitmap slices start on byte boundaries
    m = np.empty(min(nw, step), dtype=bool)
    if small:
        m_el = np.empty(min(n, step * lanes + lanes), dtype=bool)
        x = np.empty(m_el.size, dtype=a.dtype)
    for s in range(0, max(nw, 1), step):
        e = min(nw, s + step)
        if ha is not None:
            ha.update(wa[s:e])
        hb.update(wb[s:e])
        mm = m[: e - s]
        np.not_equal(wa[s:e], wb[s:e], out=mm)
        ne[s >> 3 : (e + 7) >> 3] = np.packbits(mm, bitorder="little")
        if small:
            es, ee = s * lanes, (e * lanes if e < nw else n)  # the last chunk takes the trailing elements
            xx, mm = x[: ee - es], m_el[: ee - es]
            np.bitwise_and(a[es:ee], small[0], out=xx)
            np.less(xx, small[1], out=mm)
            sm[es >> 3 : (ee + 7) >> 3] = np.packbits(mm, bitorder="little")
    if ha is not None:
        ha.update(a[nw * lanes :])
    hb.update(b[nw * lanes :])
    da = digest_a if ha is None else (ha.intdigest() if n else 0)
    return da, (hb.intdigest() if n else 0), ne, sm


def _changes(a: np.ndarray, b: np.ndarray, ne: np.ndarray, fp4: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Changed positions (int64, ascending; nibbles for FP4) with their old and new codes, from the
    bitmap of differing words: gather those words, then look inside them."""
    lanes = 8 // a.itemsize
    nw = a.nbytes // 8
    w = _set_bits(ne)
    wa, wb = np.take(a[: nw * lanes].view(np.uint64), w), np.take(b[: nw * lanes].view(np.uint64), w)
    ta, tb = a[nw * lanes :], b[nw * lanes :]  # trailing elements (less than a word)
    tail = np.flatnonzero(ta != tb)
    if fp4:
        ba, bb = wa.view(np.uint8), wb.view(np.uint8)
        x = ba ^ bb
        f = np.flatnonzero(np.stack([(x & 0x0F) != 0, x >= 0x10], axis=1).reshape(-1))  # (byte, nibble) in order
        byte, sh = f >> 1, (f & 1).astype(np.uint8) * np.uint8(4)
        pos = (np.take(w, f >> 4) << 4) | (f & 15)
        old, new = (np.take(ba, byte) >> sh) & 0x0F, (np.take(bb, byte) >> sh) & 0x0F
        if tail.size:
            tpos, told, tnew = _nibble_changes(tail, np.take(ta, tail), np.take(tb, tail))
            pos = np.concatenate([pos, tpos + 2 * nw * lanes])
            old, new = np.concatenate([old, told]), np.concatenate([new, tnew])
        return pos, old, new
    va, vb = wa.view(a.dtype), wb.view(a.dtype)
    f = np.flatnonzero(va != vb)
    if lanes == 1:
        pos = np.take(w, f)
    else:
        sh = lanes.bit_length() - 1
        pos = (np.take(w, f >> sh) << sh) | (f & (lanes - 1))
    old, new = np.take(va, f), np.take(vb, f)
    if tail.size:
        pos = np.concatenate([pos, tail + nw * lanes])
        old, new = np.concatenate([old, np.take(ta, tail)]), np.concatenate([new, np.take(tb, tail)])
    return pos, old, new


def _nibble_changes(units: np.ndarray, ai: np.ndarray, bi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Changed FP4 bytes -> changed nibble positions (ascending) with their old and new codes."""
    x = ai ^ bi
    f = np.flatnonzero(np.stack([(x & 0x0F) != 0, x >= 0x10], axis=1).reshape(-1))  # (byte, lo/hi) in order
    r, c = f >> 1, f & 1
    sh = c.astype(np.uint8) * np.uint8(4)
    return (np.take(units, r) << 1) | c, (np.take(ai, r) >> sh) & 0x0F, (np.take(bi, r) >> sh) & 0x0F


def _h2(k: float, n: float) -> float:
    """``n * H(k / n)`` in bits: the order-0 cost of a mask of ``k`` changes among ``n`` positions."""
    if n <= 0 or k <= 0 or k >= n:
        return 0.0
    p = k / n
    return -n * (p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _h2v(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """:func:`_h2` elementwise."""
    k, n = k.astype(np.float64), n.astype(np.float64)
    p = np.clip(k / np.maximum(n, 1), 1e-300, 1 - 1e-16)
    return np.where((k > 0) & (k < n), -n * (p * np.log2(p) + (1 - p) * np.log2(1 - p)), 0.0)


_SPLIT_BLOCKS, _SPLIT_BLOCK = 16, 1024


def _choose_split(a: np.ndarray, b: np.ndarray, layout: tuple[int, int]) -> int:
    """Magnitude threshold ``T`` (a binade boundary) for the two classes, or 0 for none, estimated
    before the scan on contiguous samples spread over the tensor (all of it if small): changes and
    positions per binade of the base. Only an estimate: a poor choice costs size, never correctness."""
    n = a.size
    if n <= _SPLIT_BLOCKS * _SPLIT_BLOCK:
        sa, sb = a, b
    else:
        starts = np.linspace(0, n - _SPLIT_BLOCK, _SPLIT_BLOCKS).astype(np.int64)
        sa = np.concatenate([a[s : s + _SPLIT_BLOCK] for s in starts])
        sb = np.concatenate([b[s : s + _SPLIT_BLOCK] for s in starts])
    mag, mb = layout
    nexp = (mag >> mb) + 1
    exps = ((sa & mag) >> mb).astype(np.intp)
    changed = sa != sb
    ks_total = int(np.count_nonzero(changed))
    if ks_total < 16 or ks_total > GAPS_BELOW * sa.size:  # too few to tell, or not a sparse delta
        return 0
    kc = np.cumsum(np.bincount(exps[changed], minlength=nexp))[:-1]  # class "small": binades below e
    nc = np.cumsum(np.bincount(exps, minlength=nexp))[:-1]
    ns = sa.size
    split = _h2v(kc, nc) + _h2v(ks_total - kc, np.full_like(nc, ns))  # the rest is coded over all positions
    e = int(np.argmin(split))
    if split[e] >= _SPLIT_GAIN * _h2(ks_total, ns):
        return 0
    return (e + 1) << mb


# digests of tensors this process encoded as ``new``: the publisher's next base, hashed already
_DIGESTS: dict[int, tuple] = {}


def _digest_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t._version, t.dtype, t.numel(), t.is_contiguous())


def _cached_digest(t: torch.Tensor) -> int | None:
    entry = _DIGESTS.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == _digest_key(t):
        return entry[2]
    return None


def _remember_digest(t: torch.Tensor, digest: int) -> None:
    if t.device.type != "cpu":
        return
    key = id(t)
    try:
        ref = weakref.ref(t, lambda _, key=key: _DIGESTS.pop(key, None))
    except TypeError:
        return
    _DIGESTS[key] = (ref, _digest_key(t), digest)


def _rice_r(g_sum: int, k: int) -> int:
    """Rice parameter: quotients average about 6, so J rarely escapes (q >= 31)."""
    mean = g_sum / k
    return max(0, round(math.log2(mean / 6))) if mean > 6 else 0


def _code_class(ranks: np.ndarray, v: np.ndarray, vbase: int) -> tuple[int, list[tuple[np.ndarray, bool]]]:
    """One class's changes (ascending ranks within the class, values ``>= vbase``) -> r and streams."""
    k = ranks.size
    if k == 0:
        return 0, [(np.zeros(0, dtype=np.uint8), False)] * 4
    g = np.empty(k, dtype=np.int32 if int(ranks[-1]) < 1 << 31 else np.int64)
    g[0] = ranks[0]
    np.subtract(ranks[1:], ranks[:-1], out=g[1:], casting="unsafe")
    g[1:] -= 1
    r = _rice_r(int(ranks[-1]) + 1 - k, k)
    q = g >> r if r else g
    s = v - v.dtype.type(vbase) if vbase else v
    jq = np.minimum(q, _QC - 1).astype(np.uint8)
    jv = np.minimum(s, _ZV - 1).astype(np.uint8)
    esc_q, esc_v = jq == _QC - 1, jv == _ZV - 1
    jq *= np.uint8(_ZV)
    jq |= jv
    eq = np.compress(esc_q, q) - (_QC - 1) if esc_q.any() else np.zeros(0, dtype=np.uint8)
    ez = np.compress(esc_v, s) - s.dtype.type(_ZV - 1) if esc_v.any() else np.zeros(0, dtype=np.uint8)
    low = _pack_bits(g & ((1 << r) - 1), r)
    return r, [(jq, True), (low, False), (_varint_encode(eq), True), (_varint_encode(ez), True)]


def encode_delta(prev: torch.Tensor, new: torch.Tensor, *, level: int = 1, classes: bool = True) -> bytes:
    """Delta record turning ``prev`` into ``new`` (same dtype and number of elements, CPU or not).

    ``level`` is the zstd level of the streams. ``classes=False`` skips the magnitude classes: about
    a third faster to encode, about 20% larger for weight deltas.

    The xxh3 of ``new`` is remembered (keyed by the tensor object, its storage and version counter)
    so that encoding the next version against it, as the publisher does, does not hash it again."""
    if prev.dtype != new.dtype:
        raise ValueError(f"dtype changed: {prev.dtype} -> {new.dtype}")
    if prev.numel() != new.numel():
        raise ValueError(f"numel changed: {prev.numel()} -> {new.numel()}")
    if prev.dtype not in _DTYPE_ID:
        raise ValueError(f"unsupported dtype {prev.dtype}")
    dtype = prev.dtype
    bits = _width(dtype)
    fp4 = bits == 4
    a, b = _bits(prev), _bits(new)
    n = a.size * 2 if fp4 else a.size
    layout = _FLOAT_LAYOUT.get(dtype)
    t = _choose_split(a, b, layout) if classes and layout is not None and n >= _SPLIT_MIN_K else 0
    da, db, ne, sm = _scan(a, b, (layout[0], t) if t else None, _cached_digest(prev))
    _remember_digest(new, db)
    digests = (da, db)
    idx, old, nv = _changes(a, b, ne, fp4)
    k = idx.size
    if k == 0:
        return _record(dtype, IDX_NONE, VAL_NEW, n, 0, digests, [], [], level)
    p = k / n
    if p >= GAPS_BELOW:
        old, nv = (_nibbles(a), _nibbles(b)) if fp4 else (a, b)
        vmode = _choose_plane_mode(old, nv, bits)
        streams = [(v, True) for v in _planes(_forward(vmode, old, nv, bits), bits)]
        return _record(dtype, IDX_ALL, vmode, n, k, digests, [], streams, level)

    # gaps: values
    if fp4 and k >= _RANK_MIN_K:
        vmode, vbase = VAL_RANK, 0
        pair = (old.astype(np.intp) << 4) | nv
        table = np.argsort(-np.bincount(pair, minlength=256).reshape(16, 16), axis=1, kind="stable").astype(np.uint8)
        inv = np.empty((16, 16), dtype=np.uint8)
        inv[np.arange(16)[:, None], table] = np.arange(16, dtype=np.uint8)[None, :]
        v = np.take(inv.reshape(-1), pair)
        streams = [(_pack_nibbles(table.reshape(-1)), False)]
    else:
        vmode = VAL_SUB if fp4 or layout is not None else _choose_symbol_mode(old, nv, bits)
        vbase = 0 if vmode == VAL_NEW else 1
        v = _forward(vmode, old, nv, bits)
        streams = []
    # gaps: classes (kept only if the exact counts confirm the sampled estimate)
    if t:
        in_small = (old & layout[0]) < t
        ks = int(np.count_nonzero(in_small))
        words = sm.view(np.uint64)
        ns = int(np.bitwise_count(words).sum(dtype=np.int64))
        if _h2(ks, ns) + _h2(k - ks, n) >= _SPLIT_GAIN * _h2(k, n) - 8 * 200:  # a class costs ~200 B
            t = 0
    params = [t]
    if t:
        rest = ~in_small
        classes = [
            (_rank(words, np.compress(in_small, idx)), np.compress(in_small, v)),
            (np.compress(rest, idx), np.compress(rest, v)),
        ]
    else:
        classes = [(idx, v)]
    for ranks, cv in classes:
        r, cs = _code_class(ranks, cv, vbase)
        params += [r, ranks.size]
        streams += cs
    return _record(dtype, IDX_GAPS, vmode, n, k, digests, params, streams, level)


# --------------------------------------------------------------------------- decoder


def _parse(payload: memoryview) -> tuple[tuple, list[int], list[np.ndarray], list[int]]:
    """Validate a tensor record's framing; return its header ``(magic, dtype id, index mode, value
    mode, stream count, n, k, base digest, new digest)``, params, decompressed streams and their
    stored sizes."""
    if len(payload) < _HEAD.size:
        raise DeltaFormatError(f"tensor record of {len(payload)} bytes is shorter than its header")
    magic, dtype_id, imode, vmode, nstreams, base_digest, new_digest = _HEAD.unpack_from(payload, 0)
    n, pos = _read_uv(payload, _HEAD.size)
    k, pos = _read_uv(payload, pos)
    head = (magic, dtype_id, imode, vmode, nstreams, n, k, base_digest, new_digest)
    if magic != _MAGIC_T:
        raise DeltaFormatError(f"bad tensor record magic {bytes(magic)!r}")
    if dtype_id >= len(_DTYPES) or imode not in _IDX_NAMES or vmode not in _VAL_NAMES or k > n:
        raise DeltaFormatError("bad tensor record header")
    dtype = _DTYPES[dtype_id]
    bits = _width(dtype)
    params: list[int] = []
    if imode == IDX_NONE:
        if k != 0:
            raise DeltaFormatError("index mode none with changes")
        expect: list[int | None] = []
    elif imode == IDX_GAPS:
        if k == 0 or (vmode == VAL_RANK and bits != 4):
            raise DeltaFormatError("bad gaps record header")
        t, pos = _read_uv(payload, pos)
        layout = _FLOAT_LAYOUT.get(dtype)
        if t and (layout is None or t > layout[0] or t & ((1 << layout[1]) - 1)):
            raise DeltaFormatError(f"bad magnitude threshold {t}")
        params.append(t)
        expect = [128] if vmode == VAL_RANK else []
        total = 0
        for _ in range(2 if t else 1):
            r, pos = _read_uv(payload, pos)
            kc, pos = _read_uv(payload, pos)
            if r > 63 or kc > n:
                raise DeltaFormatError("bad class parameters")
            params += [r, kc]
            total += kc
            expect += [kc, _packed_bits_len(kc, r), None, None]
        if total != k:
            raise DeltaFormatError(f"classes hold {total} changes, header says {k}")
    else:
        if k == 0:
            raise DeltaFormatError("dense index mode without changes")
        expect = _plane_lengths(n, bits)
    if nstreams != len(expect):
        raise DeltaFormatError(f"tensor record has {nstreams} streams, expected {len(expect)}")
    table = []
    for _ in range(nstreams):
        if pos >= len(payload):
            raise DeltaFormatError("truncated stream table")
        codec = payload[pos]
        stored, pos = _read_uv(payload, pos + 1)
        raw_len, pos = _read_uv(payload, pos) if codec == 1 else (stored, pos)
        table.append((codec, stored, raw_len))
    streams = []
    for i, (codec, stored, raw_len) in enumerate(table):
        want = expect[i]
        bad = codec > 1 or (want is not None and raw_len != want) or (want is None and raw_len > 10 * max(k, 1))
        if bad or pos + stored > len(payload):
            raise DeltaFormatError(f"stream {i}: bad or truncated (codec {codec}, {stored}/{raw_len} bytes)")
        body = payload[pos : pos + stored]
        pos += stored
        if codec == 1:
            try:
                data = _zd().decompress(body, max_output_size=raw_len)
            except zstandard.ZstdError as exc:
                raise DeltaFormatError(f"stream {i}: {exc}") from None
            if len(data) != raw_len:
                raise DeltaFormatError(f"stream {i}: {len(data)} bytes, expected {raw_len}")
        else:
            data = body
        streams.append(np.frombuffer(data, dtype=np.uint8))
    if pos != len(payload):
        raise DeltaFormatError(f"{len(payload) - pos} trailing bytes after the tensor record")
    return head, params, streams, [t[1] for t in table]


def _decode_class(streams: list[np.ndarray], kc: int, r: int, vbase: int) -> tuple[np.ndarray, np.ndarray]:
    """One class's symbol, Rice and escape streams -> ascending ranks (int64) and values (uint64)."""
    j, low, eq_buf, ez_buf = streams
    q = (j >> 3).astype(np.int64)
    esc_q = np.flatnonzero(q == _QC - 1)
    if esc_q.size or eq_buf.size:
        extra = _varint_decode(eq_buf, esc_q.size)
        if esc_q.size and int(extra.max()) >= 1 << 62:
            raise DeltaFormatError("gap escape out of range")
        q[esc_q] += extra.astype(np.int64)
    g = (q << r) | _unpack_bits(low, kc, r) if r else q
    g += 1
    ranks = _cumsum(g)
    ranks -= 1
    v = (j & 7).astype(np.uint64)
    esc_v = np.flatnonzero(v == _ZV - 1)
    if esc_v.size or ez_buf.size:
        v[esc_v] += _varint_decode(ez_buf, esc_v.size)
    if vbase:
        v += np.uint64(vbase)
    return ranks, v


def _select_small(small_pk: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Positions of the set bits with the given (ascending) ranks."""
    ones = _set_bits(small_pk)
    if ranks.size and (ranks[0] < 0 or ranks[-1] >= ones.size):
        raise DeltaFormatError("small-class rank out of range")
    return np.take(ones, ranks)


def _apply(prev: torch.Tensor, payload: bytes | bytearray | memoryview, want_idx: bool):
    """Decode a tensor record against ``prev``: (new tensor, changed positions or None).

    The base digest is only computed when something fails (to report :class:`DeltaBaseMismatch`
    rather than a damaged record): a reconstruction whose digest matches is the right tensor
    whatever the base was."""
    head, params, streams, _ = _parse(memoryview(payload).cast("B"))
    _, dtype_id, imode, vmode, _, n, k, base_digest, new_digest = head
    dtype = _DTYPES[dtype_id]
    if prev.dtype != dtype:
        raise DeltaBaseMismatch(f"delta is for {dtype}, base tensor is {prev.dtype}")
    bits = _width(dtype)
    fp4 = bits == 4
    a = _bits(prev)
    if (a.size * 2 if fp4 else a.size) != n:
        raise DeltaBaseMismatch(f"delta is for {n} positions, base tensor has {prev.numel()} elements")
    try:
        out, idx = _reconstruct(a, imode, vmode, params, streams, n, k, bits, fp4, dtype, want_idx)
        if _digest(out) != new_digest:
            raise DeltaChecksumMismatch("reconstructed tensor's digest differs from the encoder's")
    except (ValueError, IndexError, OverflowError) as exc:
        if _digest(a) != base_digest:
            raise DeltaBaseMismatch("base tensor contents differ from the delta's base (digest mismatch)") from None
        if isinstance(exc, DeltaError):
            raise
        raise DeltaFormatError(f"cannot decode the tensor record: {exc}") from None
    size = torch.empty(0, dtype=dtype).element_size()
    tout = torch.from_numpy(out.view(_SINT[size])).view(dtype).reshape(prev.shape)
    return tout, idx


def _reconstruct(a, imode, vmode, params, streams, n, k, bits, fp4, dtype, want_idx):
    idx = None
    if imode == IDX_NONE:
        return a.copy(), np.zeros(0, dtype=np.int64)
    if imode == IDX_ALL:
        old = _nibbles(a) if fp4 else a
        newv = _inverse(vmode, old, _unplanes(streams, n, bits, a.dtype), bits)
        out = _pack_nibbles(newv) if fp4 else newv
        if want_idx:
            idx = np.flatnonzero(old != newv)
        return (out if out.flags.writeable else out.copy()), idx
    idx, v, vmode = _decode_gaps(a, streams, params, n, vmode, bits, dtype)
    out = a.copy()
    if fp4:
        byte, hi = idx >> 1, (idx & 1).astype(bool)
        shift = hi.astype(np.uint8) * np.uint8(4)
        old = (np.take(a, byte) >> shift) & 0x0F
        newv = v if vmode == -1 else _inverse(vmode, old, v.astype(np.uint8), bits)
        lo = ~hi
        bl, bh = np.compress(lo, byte), np.compress(hi, byte)
        np.put(out, bl, (np.take(out, bl) & 0xF0) | np.compress(lo, newv))
        np.put(out, bh, (np.take(out, bh) & 0x0F) | (np.compress(hi, newv) * np.uint8(16)))
    else:
        np.put(out, idx, _inverse(vmode, np.take(a, idx), v.astype(a.dtype, copy=False), bits))
    if want_idx and imode == IDX_GAPS and params[0]:
        idx = np.sort(idx)
    return out, idx


def _decode_gaps(a, streams, params, n, vmode, bits, dtype):
    """gaps mode -> positions, values and the transform to invert (-1: values are new FP4 codes)."""
    t = params[0]
    if vmode == VAL_RANK:
        table = _nibbles(streams[0])
        streams = streams[1:]
    vbase = 1 if vmode in (VAL_SUB, VAL_XOR) else 0
    decoded = []
    for c in range(2 if t else 1):
        r, kc = params[1 + 2 * c], params[2 + 2 * c]
        decoded.append(_decode_class(streams[4 * c : 4 * c + 4], kc, r, vbase))
    if t:
        small_pk = _small_bitmap(a, _FLOAT_LAYOUT[dtype][0], t)
        pos_small = _select_small(small_pk, decoded[0][0])
        pos_rest = decoded[1][0]
        if pos_rest.size and (pos_rest[0] < 0 or pos_rest[-1] >= n):
            raise DeltaFormatError("changed positions out of range")
        idx = np.concatenate([pos_small, pos_rest])
        v = np.concatenate([decoded[0][1], decoded[1][1]])
    else:
        idx, v = decoded[0]
        if idx.size and idx[-1] >= n:
            raise DeltaFormatError("changed positions out of range")
    if vmode == VAL_RANK:
        if v.size and int(v.max()) > 15:
            raise DeltaFormatError("FP4 rank out of range")
        old = (np.take(a, idx >> 1) >> ((idx & 1).astype(np.uint8) * np.uint8(4))) & 0x0F
        return idx, np.take(table, (old.astype(np.intp) << 4) | v.astype(np.intp)), -1
    limit = (1 << bits) - 1
    if v.size and int(v.max()) > limit:
        raise DeltaFormatError("value out of range for the dtype")
    return idx, v, vmode


def apply_delta(prev: torch.Tensor, payload: bytes | bytearray | memoryview) -> torch.Tensor:
    """``prev`` + delta record -> the new tensor (a fresh CPU tensor shaped like ``prev``); ``prev``
    is not modified. Raises :class:`DeltaError` rather than ever returning a wrong tensor."""
    return _apply(prev, payload, False)[0]


def delta_stats(payload: bytes | bytearray | memoryview) -> dict:
    """What a tensor record chose: index and value mode, classes, positions, changed, stream sizes."""
    head, params, _, sizes = _parse(memoryview(payload).cast("B"))
    _, dtype_id, imode, vmode, nstreams, n, k, _, _ = head
    out = {
        "dtype": str(_DTYPES[dtype_id]).removeprefix("torch."),
        "index": _IDX_NAMES[imode],
        "values": _VAL_NAMES[vmode],
        "positions": n,
        "changed": k,
        "stream_bytes": sizes,
        "bytes": len(payload),
    }
    if imode == IDX_GAPS:
        out["split"] = params[0]
        out["classes"] = [{"r": params[i], "changed": params[i + 1]} for i in range(1, len(params), 2)]
    return out


# --------------------------------------------------------------------------- state level


def state_delta_header(base_version: int, version: int, names: list[str]) -> bytes:
    """The state record's opening: magic, header length and the JSON header naming the tensors in order."""
    header = json.dumps(
        {"format": _FORMAT, "base_version": int(base_version), "version": int(version), "tensors": list(names)},
        separators=(",", ":"),
    ).encode()
    return _MAGIC_S + struct.pack("<I", len(header)) + header


def framed_record(record: bytes) -> bytes:
    """A tensor record as it follows the header: its u64 length, then the record."""
    return _RECORD_LEN.pack(len(record)) + record


def encode_state_delta(
    prev_state: dict[str, torch.Tensor],
    new_state: dict[str, torch.Tensor],
    base_version: int,
    version: int,
    *,
    level: int = 1,
    classes: bool = True,
) -> bytes:
    """Delta of a whole weight set from ``base_version`` to ``version``. Both states must hold the
    same names, dtypes and element counts (otherwise ``ValueError``: publish a full payload).
    ``level`` and ``classes`` as in :func:`encode_delta`."""
    if set(prev_state) != set(new_state):
        raise ValueError(f"tensor set changed: {sorted(set(prev_state) ^ set(new_state))[:5]}")
    parts = [state_delta_header(base_version, version, list(new_state))]
    for name, new in new_state.items():
        parts.append(framed_record(encode_delta(prev_state[name], new, level=level, classes=classes)))
    return b"".join(parts)


def read_state_header(payload: bytes | bytearray | memoryview) -> dict:
    """The state record's JSON header, validated, with ``tensors`` as ``[name, offset, length]`` of each tensor
    record (offsets relative to ``_body``, the end of the JSON header)."""
    buf = memoryview(payload).cast("B")
    if len(buf) < 8 or bytes(buf[:4]) != _MAGIC_S:
        raise DeltaFormatError("not a state delta of format 3 (bad magic or too short)")
    (hlen,) = struct.unpack_from("<I", buf, 4)
    if 8 + hlen > len(buf):
        raise DeltaFormatError(f"header length {hlen} exceeds payload size {len(buf)}")
    try:
        header = json.loads(bytes(buf[8 : 8 + hlen]))
        ok = (
            header["format"] == _FORMAT
            and isinstance(header["base_version"], int)
            and isinstance(header["version"], int)
            and all(isinstance(name, str) for name in header["tensors"])
        )
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DeltaFormatError(f"bad state delta header: {exc}") from None
    if not ok:
        raise DeltaFormatError("bad state delta header")
    body, pos, entries = 8 + hlen, 8 + hlen, []
    for name in header["tensors"]:
        if pos + _RECORD_LEN.size > len(buf):
            raise DeltaFormatError(f"{name}: the payload ends before its record")
        (length,) = _RECORD_LEN.unpack_from(buf, pos)
        pos += _RECORD_LEN.size
        if pos + length > len(buf):
            raise DeltaFormatError(f"{name}: record length {length} runs past the payload")
        entries.append([name, pos - body, length])
        pos += length
    if pos != len(buf):
        raise DeltaFormatError(f"{len(buf) - pos} bytes after the last tensor record")
    header["tensors"] = entries
    header["_body"] = body
    return header


def apply_state_delta(
    prev_state: dict[str, torch.Tensor],
    payload: bytes | bytearray | memoryview,
    base_version: int,
    *,
    with_changes: bool = False,
) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``prev_state`` (which is ``base_version``) + state delta -> the new state (fresh tensors).

    With ``with_changes=True`` it returns ``(new_state, changes)``: ``changes[name]`` is an int64
    tensor of the ascending flat positions whose bit pattern changed (for ``float4_e2m1fn_x2``
    tensors, FP4 element = nibble positions), e.g. to stage only those elements in an engine.

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
    out, changes = {}, {}
    for name, start, length in header["tensors"]:
        try:
            out[name], idx = _apply(prev_state[name], buf[body + start : body + start + length], with_changes)
        except DeltaError as exc:
            raise type(exc)(f"{name}: {exc}") from None
        if with_changes:
            changes[name] = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))
    return (out, changes) if with_changes else out
