"""The weight data plane: one payload (serialised weights) per policy version, in JetStream.

The trainer's leader :meth:`WeightStore.put`\\ s the payload of each new version; rollout workers
:meth:`WeightStore.get` it while they keep generating with the previous one. The control plane
(``WeightsAnnounced`` on the events stream) only carries version, size and digest; the bytes live here.

Layout in stream ``<run>_WEIGHTS`` (file storage, direct get allowed)::

    <run>.weights.<version>.chunk   the payload in order, chunk_bytes per message (the last one shorter)
    <run>.weights.<version>.meta    the manifest, published after every chunk is acked

Why this shape:

* The manifest is the commit marker: a version without one is an interrupted put and is never read.
  It records the stream sequence of every chunk (as ranges), so a reader fetches chunk ``i`` by
  sequence with O(1) direct gets, pipelined, and knows each chunk's offset before it arrives.
* Chunks are close to the server's ``max_payload`` (8 MB by default): fewer, larger messages keep the
  per-message cost of server and client negligible next to the bytes.
* Put pipelines the chunk publishes (async acks, a bounded window) instead of one round trip each.
* :meth:`WeightStore.writer` is the same put fed piece by piece, for payloads produced as they are sent
  (the streamed export, :mod:`miles.sync.stream_export`): identical chunks and manifest, one chunk buffered.
* Get lands every payload byte straight in one preallocated buffer (see
  :mod:`miles.sync.transport.rawfetch`; nats-py is the fallback) and verifies the xxh3-128 digest of the whole.
  nats-py's object store, the obvious alternative, moved 64 MB in about 10 s here.
* Old versions are purged by subject after each put, keeping the newest ``keep_versions``; a reader
  still fetching a purged version gets :class:`PayloadMissing` and moves on to a newer one.

``kind="delta"`` is a second, independent key space of the same shape for ``sync.mode: delta``
(stream ``<run>_WEIGHTS_DELTA``, subjects ``<run>.wdelta.<version>.chunk|meta``): the delta that turns
the previous version into ``<version>``. The default ``kind="full"`` key space above then holds the
full anchors only. See docs/weight-sync.md.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import structlog
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from miles.bus.errors import BusError, ChecksumMismatch, PayloadMissing, TransientBusError
from miles.bus.retry import Outage, ResilientJetStream, request_across_reconnects, retrying
from miles.bus.streams import ensure_weight_stream, weight_stream_config, weight_stream_name, weight_subject_prefix
from miles.sync.checksum import ALGORITHM, digest, hasher
from miles.sync.transport.rawfetch import ChunkMissing, ChunkRequest, Endpoint, endpoint_from_client, fetch_chunks

log = structlog.get_logger(__name__)
T = TypeVar("T")

MiB = 1024 * 1024
# Room under max_payload for the protocol line and the headers JetStream adds to a direct-get reply.
CHUNK_HEADROOM = 4096
DEFAULT_WINDOW_BYTES = 32 * MiB
# Below this, ``fetch="auto"`` reads through the shared nats-py connection: the raw reader's own connection (TCP,
# TLS handshake, login) costs more than the copies it saves on a small payload (benchmarks/RESULTS.md).
RAW_FETCH_MIN_BYTES = 1 * MiB
FetchMode = Literal["auto", "raw", "client"]
Storage = Literal["file", "memory"]
Kind = Literal["full", "delta"]

__all__ = ["ChecksumMismatch", "PayloadInfo", "PayloadMissing", "PayloadWriter", "WeightStore"]


@dataclass(frozen=True, slots=True)
class PayloadInfo:
    """What a reader needs to know about a stored version (``WeightsAnnounced`` carries the same)."""

    version: int
    size: int
    chunks: int
    digest: str


@dataclass(frozen=True, slots=True)
class _Manifest:
    version: int
    size: int
    chunk_bytes: int
    digest: str
    seqs: list[tuple[int, int]]  # (first sequence, count) ranges, in chunk order

    @property
    def chunks(self) -> int:
        return sum(count for _, count in self.seqs)

    def requests(self) -> list[ChunkRequest]:
        out: list[ChunkRequest] = []
        for first, count in self.seqs:
            for seq in range(first, first + count):
                offset = len(out) * self.chunk_bytes
                out.append(ChunkRequest(seq=seq, offset=offset, length=min(self.chunk_bytes, self.size - offset)))
        return out

    def encode(self) -> bytes:
        return json.dumps(
            {
                "version": self.version,
                "size": self.size,
                "chunks": self.chunks,
                "chunk_bytes": self.chunk_bytes,
                "algorithm": ALGORITHM,
                "digest": self.digest,
                "seqs": [list(r) for r in self.seqs],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> _Manifest:
        raw = json.loads(data)
        if raw.get("algorithm") != ALGORITHM:
            raise BusError(f"weight manifest uses digest {raw.get('algorithm')!r}, expected {ALGORITHM}")
        man = cls(
            version=int(raw["version"]),
            size=int(raw["size"]),
            chunk_bytes=int(raw["chunk_bytes"]),
            digest=str(raw["digest"]),
            seqs=[(int(a), int(b)) for a, b in raw["seqs"]],
        )
        expected = -(-man.size // man.chunk_bytes) if man.size else 0
        if man.chunks != expected or man.chunks != int(raw["chunks"]):
            raise BusError(f"weight manifest of version {man.version} is inconsistent ({man.chunks} chunks)")
        return man


def _ranges(seqs: list[int]) -> list[tuple[int, int]]:
    """[5, 6, 7, 10, 11] -> [(5, 3), (10, 2)]: chunks of one put are usually contiguous."""
    out: list[tuple[int, int]] = []
    for seq in seqs:
        if out and out[-1][0] + out[-1][1] == seq:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((seq, 1))
    return out


def _version_of(subject: str) -> int | None:
    """``<run>.weights.<version>.<kind>`` -> version (None for anything else)."""
    parts = subject.split(".")
    return int(parts[-2]) if len(parts) >= 4 and parts[-2].isdigit() else None


def allocate(size: int) -> memoryview:
    """A writable ``size``-byte buffer for a payload, backed by an anonymous mmap.

    Why not ``bytearray(size)``: it zero-fills the whole buffer up front, which cost 0.16 s per 256 MB
    on the (memory-bandwidth starved) dev machine, a third of the fetch itself. An anonymous mapping
    costs nothing until the socket writes into it, and is unmapped when the last view is dropped.
    """
    if size == 0:
        return memoryview(bytearray())
    return memoryview(mmap.mmap(-1, size))


def _reuse(buf: bytearray | memoryview | None, size: int) -> memoryview | None:
    if buf is None:
        return None
    view = memoryview(buf)
    if view.readonly or view.format != "B" or view.ndim != 1 or view.nbytes < size:
        return None
    return view[:size]


def _as_bytes_view(payload: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError("weight payload must be a C-contiguous buffer")
        view = view.cast("B")
    return view


class WeightStore:
    """Chunked, verified weight payloads of one run. Create with :meth:`create`."""

    def __init__(
        self,
        js: JetStreamContext,
        run: str,
        *,
        chunk_bytes: int,
        keep_versions: int,
        fetch: FetchMode = "auto",
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        timeout_s: float = 60.0,
        kind: Kind = "full",
    ) -> None:
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be >= 1")
        self.js = js
        self.run = run
        self.chunk_bytes = chunk_bytes
        self.keep_versions = keep_versions
        self.fetch = fetch
        self.window_bytes = window_bytes
        self.timeout_s = timeout_s
        self.kind: Kind = kind
        self.stream, self.prefix = weight_stream_name(run, kind), weight_subject_prefix(run, kind)
        self._nc = js._nc  # the connection the context was made from (nats-py keeps no public accessor)
        self._api_prefix: str = getattr(js, "_prefix", "$JS.API")
        # An actor's context: chunk requests cut off by a reconnect are sent again at once (not after timeout_s).
        self._outage: Outage | None = js.outage if isinstance(js, ResilientJetStream) else None

    # ------------------------------------------------------------------ set-up

    @classmethod
    async def create(
        cls,
        js: JetStreamContext,
        run: str,
        chunk_bytes: int | None = None,
        replicas: int = 1,
        keep_versions: int = 3,
        *,
        fetch: FetchMode = "auto",
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        timeout_s: float = 60.0,
        storage: Storage = "file",
        kind: Kind = "full",
        ensure: bool = True,
    ) -> WeightStore:
        """Ensure the run's weight stream exists (idempotent; any actor may call it first), or with
        ``ensure=False`` only bind to it (an identity that may not create streams: the setup step made it).

        ``chunk_bytes`` defaults to (and is capped at) the server's ``max_payload`` minus a little headroom;
        it only shapes what this store puts, readers follow each version's manifest. ``fetch``
        picks the reader: ``raw`` (zero-copy, :mod:`miles.sync.transport.rawfetch`), ``client`` (nats-py), or
        ``auto`` (raw where the connection allows it and the payload is at least ``RAW_FETCH_MIN_BYTES``, nats-py
        otherwise or if raw fails to connect).
        ``storage="memory"`` keeps the payloads in the server's RAM (``keep_versions`` x payload size):
        gets were about 1.5x faster than from file storage on the dev machine, at the cost of that RAM
        and of losing the payloads when the server restarts (the trainer republishes on its next step).
        ``kind="delta"`` opens the delta key space instead (see the module docstring).
        """
        max_payload = js._nc.max_payload
        fits = max(1, max_payload - CHUNK_HEADROOM)
        if chunk_bytes is None:
            chunk_bytes = fits
        elif chunk_bytes > fits:
            # e.g. bus.max_payload_mb=8 against an external server left at the 1 MB default
            log.warning("weights_chunk_clamped", wanted=chunk_bytes, server_max_payload=max_payload, using=fits)
            chunk_bytes = fits
        store = cls(
            js,
            run,
            chunk_bytes=chunk_bytes,
            keep_versions=keep_versions,
            fetch=fetch,
            window_bytes=window_bytes,
            timeout_s=timeout_s,
            kind=kind,
        )
        if ensure:
            await ensure_weight_stream(js, run, kind, replicas, storage)
        return store

    def sibling(self, kind: Kind, keep_versions: int | None = None) -> WeightStore:
        """A store on the same connection and run for the other key space, without creating its stream
        (a reader only: a version that is not stored, or a stream that does not exist, is :class:`PayloadMissing`)."""
        return WeightStore(
            self.js,
            self.run,
            chunk_bytes=self.chunk_bytes,
            keep_versions=self.keep_versions if keep_versions is None else keep_versions,
            fetch=self.fetch,
            window_bytes=self.window_bytes,
            timeout_s=self.timeout_s,
            kind=kind,
        )

    def stream_config(self, replicas: int, storage: Storage = "file") -> StreamConfig:
        return weight_stream_config(self.run, self.kind, replicas, storage)

    # ------------------------------------------------------------------ subjects

    def chunk_subject(self, version: int) -> str:
        return f"{self.prefix}.{version}.chunk"

    def meta_subject(self, version: int) -> str:
        return f"{self.prefix}.{version}.meta"

    def _version_filter(self, version: int) -> str:
        return f"{self.prefix}.{version}.>"

    # ------------------------------------------------------------------ write

    async def put(self, version: int, payload: bytes | bytearray | memoryview) -> PayloadInfo:
        """Store ``payload`` as ``version`` (replacing a previous attempt at the same version), then
        purge all but the newest ``keep_versions`` versions. Returns what to announce.

        A put cut off by an outage (a chunk's ack lost in a server restart) is started again from its first
        chunk (the writer purges the partial version first) for as long as the retry layer's budget allows."""
        view = _as_bytes_view(payload)

        async def attempt() -> PayloadInfo:
            async with self.writer(version, view.nbytes) as w:
                await w.write(view)
            assert w.info is not None
            return w.info

        return await self.retried(attempt, what=f"weights v{version} into {self.stream}")

    async def retried(self, attempt: Callable[[], Awaitable[T]], *, what: str) -> T:
        """``attempt()``, started again after a transient failure when this store's JetStream context has an
        outage budget (:class:`miles.bus.retry.ResilientJetStream`); once otherwise."""
        outage = getattr(self.js, "outage", None)
        if outage is None:
            return await attempt()
        return await retrying(attempt, what=what, outage=outage)

    def writer(self, version: int, size: int | None = None) -> PayloadWriter:
        """A streaming put: ``async with store.writer(version) as w: await w.write(piece)`` ... .

        Stores exactly what :meth:`put` of the concatenated pieces stores (same chunks, manifest and
        digest), but holds at most one chunk of it: bytes go out as soon as a chunk is full, so a payload
        can be produced tensor by tensor (:mod:`miles.sync.stream_export`). ``size``, when given, is checked
        against the bytes written. The manifest (the commit) is published on a clean exit only; after an
        error the partial version has no manifest, is never read and is purged by the next put of that
        version or by :meth:`purge`. ``w.info`` is the :class:`PayloadInfo` once the block has exited.
        """
        if version < 0:
            raise ValueError("version must be >= 0")
        return PayloadWriter(self, version, size)

    async def _ack(self, fut: asyncio.Future) -> int:
        try:
            ack = await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            raise TransientBusError(f"weight chunk not acknowledged within {self.timeout_s:.0f}s") from None
        except NoRespondersError:
            # the server restarting, or no stream (deleted): the retry layer's budget tells them apart
            raise TransientBusError(f"no JetStream stream stores {self.prefix}.> (is {self.stream} there?)") from None
        return int(ack.seq)

    # ------------------------------------------------------------------ read

    async def info(self, version: int) -> PayloadInfo:
        """Size, chunk count and digest of a stored version; :class:`PayloadMissing` if it is not stored."""
        man = await self._manifest(version)
        return PayloadInfo(version=man.version, size=man.size, chunks=man.chunks, digest=man.digest)

    async def get(
        self, version: int, expected_digest: str | None = None, *, into: bytearray | memoryview | None = None
    ) -> memoryview:
        """The payload of ``version``, verified against its digest (and ``expected_digest`` if given).

        Returns a writable 1-D byte ``memoryview`` of the buffer every chunk was received into: a fresh
        one (see :func:`allocate`), or the first ``size`` bytes of ``into`` when that is large enough.
        Reusing a buffer (e.g. the previous version's, once its tensors are copied out) skips faulting in
        fresh pages, which is a large part of a fetch's cost on VMs. The view is zero-copy, compares
        equal to the same ``bytes`` and works with ``torch.frombuffer``; ``bytes(view)`` makes a copy
        for APIs that insist on ``bytes`` (``safetensors.torch.load`` does).

        Raises :class:`PayloadMissing` if the version is not (or no longer) stored and
        :class:`ChecksumMismatch` if the bytes are not the ones published.
        """
        attempts = 3
        for attempt in range(attempts):
            man = await self._manifest(version)
            if expected_digest is not None and man.digest != expected_digest:
                raise ChecksumMismatch(
                    f"weights v{version} in the store have digest {man.digest}, expected {expected_digest}"
                )
            started = time.perf_counter()
            dest = _reuse(into, man.size) or allocate(man.size)
            try:
                await self._fetch(man, dest)
            except ChunkMissing as exc:
                # Purged under us (the manifest will be gone on the next look), or, with replicas,
                # a direct get answered by a follower that is not caught up yet: look again.
                if attempt == attempts - 1:
                    raise PayloadMissing(f"weights v{version}: {exc}") from None
                await asyncio.sleep(0.1 * 2**attempt)
                continue
            actual = digest(dest)
            if actual != man.digest:
                raise ChecksumMismatch(f"weights v{version} hash to {actual}, published as {man.digest}")
            elapsed = time.perf_counter() - started
            log.debug(
                "weights_get",
                version=version,
                size=man.size,
                seconds=round(elapsed, 3),
                mb_per_s=round(man.size / MiB / elapsed, 1) if elapsed > 0 else None,
            )
            return dest
        raise AssertionError("unreachable")

    async def _manifest(self, version: int) -> _Manifest:
        # A leader read (not direct): consistent with the put that published it, even with replicas.
        try:
            msg = await self.js.get_msg(self.stream, subject=self.meta_subject(version))
        except NotFoundError:
            raise PayloadMissing(f"weights v{version} are not in {self.stream}") from None
        assert msg.data is not None
        man = _Manifest.decode(msg.data)
        if man.version != version:
            raise BusError(f"manifest on {self.meta_subject(version)} describes version {man.version}")
        return man

    async def _fetch(self, man: _Manifest, dest: memoryview) -> None:
        requests = man.requests()
        if not requests:
            return
        window = max(2, self.window_bytes // man.chunk_bytes)  # always overlap two chunks
        small = self.fetch == "auto" and man.size < RAW_FETCH_MIN_BYTES
        endpoint = endpoint_from_client(self._nc) if self.fetch != "client" and not small else None
        if self.fetch == "raw" and endpoint is None:
            raise BusError("raw weight fetch is not possible over this connection (websocket or TLS-first)")
        if endpoint is not None:
            try:
                await self._fetch_raw(endpoint, man, requests, dest, window)
                return
            except (ChunkMissing, ChecksumMismatch):
                raise
            except BusError as exc:
                if self.fetch == "raw":
                    raise
                log.warning("weights_raw_fetch_failed", version=man.version, error=str(exc), fallback="nats-py")
        await self._fetch_client(man, requests, dest, window)

    async def _fetch_raw(
        self, endpoint: Endpoint, man: _Manifest, requests: list[ChunkRequest], dest: memoryview, window: int
    ) -> None:
        await fetch_chunks(
            endpoint,
            stream=self.stream,
            subject=self.chunk_subject(man.version),
            requests=requests,
            dest=dest,
            window=window,
            timeout_s=self.timeout_s,
            api_prefix=self._api_prefix,
        )

    async def _request(self, subject: str, payload: bytes) -> Msg:
        if self._outage is None:
            return await self._nc.request(subject, payload, timeout=self.timeout_s)
        return await request_across_reconnects(self._nc, subject, payload, self.timeout_s, self._outage)

    async def _fetch_client(self, man: _Manifest, requests: list[ChunkRequest], dest: memoryview, window: int) -> None:
        """nats-py path: pipelined direct gets through the shared connection (slower: extra copies)."""
        subject = self.chunk_subject(man.version)
        api = f"{self._api_prefix}.DIRECT.GET.{self.stream}"
        gate = asyncio.Semaphore(window)

        async def one(index: int, req: ChunkRequest) -> None:
            async with gate:
                try:
                    msg = await self._request(api, b'{"seq":%d}' % req.seq)
                except (NatsTimeoutError, asyncio.TimeoutError):
                    raise BusError(f"direct get of seq {req.seq} timed out after {self.timeout_s:.0f}s") from None
                except NoRespondersError:
                    raise BusError(f"no direct-get responder for {self.stream}") from None
            headers = msg.headers or {}
            status = headers.get("Status")
            if status == "404":
                raise ChunkMissing(index, req.seq)
            if status:
                raise BusError(f"direct get of seq {req.seq} failed: {status} {headers.get('Description', '')}")
            if headers.get("Nats-Subject") != subject:
                raise ChecksumMismatch(f"stream seq {req.seq} holds {headers.get('Nats-Subject')!r}, not {subject}")
            if len(msg.data) != req.length:
                raise ChecksumMismatch(f"chunk {index} has {len(msg.data)} bytes, the manifest says {req.length}")
            dest[req.offset : req.offset + req.length] = msg.data

        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(requests)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    # ------------------------------------------------------------------ versions

    async def _subjects(self) -> dict[str, int]:
        try:
            info = await self.js.stream_info(self.stream, subjects_filter=f"{self.prefix}.>")
        except NotFoundError:
            return {}
        return dict(info.state.subjects or {})

    async def versions(self) -> list[int]:
        """Complete (manifest published) versions in the store, ascending."""
        found = {_version_of(subj) for subj in await self._subjects() if subj.endswith(".meta")}
        return sorted(v for v in found if v is not None)

    async def latest(self) -> int | None:
        """Newest complete version, or ``None`` if the store is empty."""
        found = await self.versions()
        return found[-1] if found else None

    async def purge(self, keep: int | None = None, *, newest: int | None = None) -> list[int]:
        """Remove every version older than the newest ``keep`` (default ``keep_versions``) complete ones,
        including interrupted puts; newer partial versions (a put in progress) are left alone.

        ``newest``: the version the writer just put. Versions above it count for nothing: they are not the
        writer's (versions only grow), and were they counted, messages replayed into the stream (an earlier
        run's versions 4-6) would have the writer purge the version it had just put."""
        keep = self.keep_versions if keep is None else keep
        subjects = await self._subjects()
        complete = sorted(
            {
                v
                for s in subjects
                if s.endswith(".meta") and (v := _version_of(s)) is not None and (newest is None or v <= newest)
            }
        )
        if len(complete) <= keep:
            return []
        oldest_kept = complete[-keep] if keep > 0 else complete[-1] + 1
        stale = sorted({v for s in subjects if (v := _version_of(s)) is not None and v < oldest_kept})
        for version in stale:
            await self._purge_subject(self._version_filter(version))
        return stale

    async def delete(self, version: int) -> None:
        """Remove one version (all of its messages)."""
        await self._purge_subject(self._version_filter(version))

    async def _purge_subject(self, subject: str) -> None:
        await self.js.purge_stream(self.stream, subject=subject)


class PayloadWriter:
    """One streaming put (see :meth:`WeightStore.writer`): chunking, pipelined publishes, the manifest.

    Pieces are cut at ``chunk_bytes`` boundaries as they arrive: whole chunks inside a piece are published
    straight from it (nats-py copies a message into its send buffer, so the caller may reuse the piece once
    :meth:`write` returns), and only a chunk that straddles two pieces is assembled in one staging buffer.
    At most ``window_bytes`` of chunks await their acks, as in :meth:`WeightStore.put`.
    """

    def __init__(self, store: WeightStore, version: int, size: int | None) -> None:
        self.store = store
        self.version = version
        self.expected_size = size
        self.info: PayloadInfo | None = None
        self._subject = store.chunk_subject(version)
        self._chunk = store.chunk_bytes
        self._window = max(2, store.window_bytes // store.chunk_bytes)
        self._buf = bytearray(self._chunk)
        self._fill = 0
        self._size = 0
        self._hash = hasher()
        self._pending: deque[asyncio.Future] = deque()
        self._seqs: list[int] = []
        self._started = 0.0
        self._open = False

    async def __aenter__(self) -> PayloadWriter:
        self._started = time.perf_counter()
        await self.store._purge_subject(self.store._version_filter(self.version))
        self._open = True
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._open = False
        if exc_type is not None:
            for fut in self._pending:
                fut.cancel()
            log.warning("weights_put_aborted", version=self.version, written=self._size, error=repr(exc))
            return
        try:
            await self._finish()
        finally:
            for fut in self._pending:
                fut.cancel()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` to the payload (publishing every chunk it completes)."""
        if not self._open:
            raise RuntimeError("PayloadWriter.write outside its async with block")
        view = _as_bytes_view(data)
        self._hash.update(view)
        self._size += view.nbytes
        if self._fill:
            take = min(self._chunk - self._fill, view.nbytes)
            self._buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill < self._chunk:
                return
            await self._publish(memoryview(self._buf))
            self._fill = 0
        while view.nbytes >= self._chunk:
            await self._publish(view[: self._chunk])
            view = view[self._chunk :]
        if view.nbytes:
            self._buf[: view.nbytes] = view
            self._fill = view.nbytes

    async def _publish(self, chunk: memoryview) -> None:
        self._pending.append(await self.store.js.publish_async(self._subject, chunk))
        while len(self._pending) >= self._window:
            self._seqs.append(await self.store._ack(self._pending.popleft()))

    async def _finish(self) -> None:
        if self._fill:
            await self._publish(memoryview(self._buf)[: self._fill])
            self._fill = 0
        while self._pending:
            self._seqs.append(await self.store._ack(self._pending.popleft()))
        if self.expected_size is not None and self._size != self.expected_size:
            raise BusError(f"weights v{self.version}: wrote {self._size} bytes, expected {self.expected_size}")
        dig = self._hash.hexdigest()
        store = self.store
        manifest = _Manifest(
            version=self.version, size=self._size, chunk_bytes=self._chunk, digest=dig, seqs=_ranges(self._seqs)
        )
        try:
            await store.js.publish(store.meta_subject(self.version), manifest.encode(), timeout=store.timeout_s)
        except (NatsTimeoutError, NoRespondersError) as exc:
            what = type(exc).__name__
            raise BusError(f"weight manifest of version {self.version} not acknowledged: {what}") from None
        elapsed = time.perf_counter() - self._started
        purged = await store.purge(newest=self.version)
        log.info(
            "weights_put",
            version=self.version,
            size=self._size,
            chunks=manifest.chunks,
            seconds=round(elapsed, 3),
            mb_per_s=round(self._size / MiB / elapsed, 1) if elapsed > 0 else None,
            purged=purged,
        )
        self.info = PayloadInfo(version=self.version, size=self._size, chunks=manifest.chunks, digest=dig)
