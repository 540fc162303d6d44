"""WeightStore against a real nats-server: round trips, integrity, missing versions, purging."""

from __future__ import annotations

import array
import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from nats.aio.client import Client

from miles.bus.errors import BusError
from miles.sync.checksum import digest
from miles.sync.transport import dataplane
from miles.sync.transport.dataplane import ChecksumMismatch, PayloadInfo, PayloadMissing, WeightStore
from miles.sync.transport.rawfetch import Endpoint

CHUNK = 64 * 1024
FETCH_MODES = ["raw", "client"]


async def _store(nc: Client, fetch: str = "auto", keep: int = 3, chunk: int | None = CHUNK) -> WeightStore:
    return await WeightStore.create(nc.jetstream(), "t", chunk_bytes=chunk, keep_versions=keep, fetch=fetch)  # type: ignore[arg-type]


@pytest.mark.parametrize("fetch", FETCH_MODES)
@pytest.mark.parametrize(
    ("size", "chunks"),
    [(0, 0), (1, 1), (CHUNK, 1), (CHUNK + 1, 2), (17 * CHUNK - 5, 17)],
    ids=["empty", "one-byte", "exactly-one-chunk", "one-chunk-plus-one", "many-chunks"],
)
async def test_round_trip(nc: Client, fetch: str, size: int, chunks: int) -> None:
    store = await _store(nc, fetch)
    payload = os.urandom(size)
    info = await store.put(7, payload)
    assert info == PayloadInfo(version=7, size=size, chunks=chunks, digest=digest(payload))
    got = await store.get(7, expected_digest=info.digest)
    assert len(got) == size and got == payload
    assert await store.info(7) == info


async def test_large_payload_with_default_chunks(nc: Client) -> None:
    store = await _store(nc, chunk=None)
    assert store.chunk_bytes == nc.max_payload - dataplane.CHUNK_HEADROOM
    payload = os.urandom(3 * store.chunk_bytes + 12345)
    info = await store.put(1, memoryview(payload))
    assert info.chunks == 4
    assert await store.get(1) == payload


async def test_put_accepts_typed_buffers_and_chunk_bytes_is_capped(nc: Client) -> None:
    store = await _store(nc, chunk=64 * 1024 * 1024)  # larger than the server allows: capped
    assert store.chunk_bytes < nc.max_payload
    floats = array.array("f", range(10_000))
    info = await store.put(2, memoryview(floats))
    assert info.size == 40_000
    assert await store.get(2) == floats.tobytes()


async def test_second_actor_shares_the_store(nc: Client, nats_server: str) -> None:
    from miles.bus.connect import connect

    writer = await _store(nc)
    other = await connect(nats_server, name="reader")
    try:
        reader = await _store(other, chunk=None)  # its own chunk size does not matter for reading
        payload = os.urandom(5 * CHUNK)
        info = await writer.put(3, payload)
        assert await reader.latest() == 3
        first, second = await asyncio.gather(reader.get(3, info.digest), reader.get(3, info.digest))
        assert first == payload and second == payload
    finally:
        await other.close()


@pytest.mark.parametrize("fetch", FETCH_MODES)
async def test_expected_digest_mismatch(nc: Client, fetch: str) -> None:
    store = await _store(nc, fetch)
    await store.put(1, b"weights")
    with pytest.raises(ChecksumMismatch, match="expected"):
        await store.get(1, expected_digest=digest(b"other weights"))


async def _forge(nc: Client, store: WeightStore, version: int, index: int, data: bytes) -> None:
    """Publish ``data`` as a new chunk message and a manifest that points chunk ``index`` at it."""
    js = nc.jetstream()
    meta = await js.get_msg(store.stream, subject=store.meta_subject(version))
    assert meta.data is not None
    manifest = json.loads(meta.data)
    bad = await js.publish(store.chunk_subject(version), data)
    seqs = [seq for first, count in manifest["seqs"] for seq in range(first, first + count)]
    seqs[index] = bad.seq
    manifest["seqs"] = [[seq, 1] for seq in seqs]
    await js.publish(store.meta_subject(version), json.dumps(manifest).encode())


@pytest.mark.parametrize("fetch", FETCH_MODES)
async def test_corrupted_chunk_is_detected(nc: Client, fetch: str) -> None:
    store = await _store(nc, fetch)
    payload = os.urandom(4 * CHUNK)
    info = await store.put(1, payload)
    corrupted = bytearray(payload[CHUNK : 2 * CHUNK])
    corrupted[100] ^= 0xFF
    await _forge(nc, store, 1, 1, bytes(corrupted))
    with pytest.raises(ChecksumMismatch, match="hash to"):
        await store.get(1)
    with pytest.raises(ChecksumMismatch):
        await store.get(1, expected_digest=info.digest)


@pytest.mark.parametrize("fetch", FETCH_MODES)
async def test_chunk_of_wrong_size_is_detected(nc: Client, fetch: str) -> None:
    store = await _store(nc, fetch)
    await store.put(1, os.urandom(3 * CHUNK))
    await _forge(nc, store, 1, 0, b"short")
    with pytest.raises(ChecksumMismatch, match="bytes, the manifest says"):
        await store.get(1)


@pytest.mark.parametrize("fetch", FETCH_MODES)
async def test_missing_version(nc: Client, fetch: str) -> None:
    store = await _store(nc, fetch)
    with pytest.raises(PayloadMissing):
        await store.get(42)
    with pytest.raises(PayloadMissing):
        await store.info(42)
    assert await store.latest() is None


@pytest.mark.parametrize("fetch", FETCH_MODES)
async def test_chunk_deleted_under_a_manifest(nc: Client, fetch: str) -> None:
    store = await _store(nc, fetch)
    await store.put(1, os.urandom(3 * CHUNK))
    meta = await nc.jetstream().get_msg(store.stream, subject=store.meta_subject(1))
    assert meta.data is not None
    first_seq = json.loads(meta.data)["seqs"][0][0]
    await nc.jetstream().delete_msg(store.stream, first_seq + 1)
    with pytest.raises(PayloadMissing, match="not found"):
        await store.get(1)


async def test_purge_keeps_newest_versions(nc: Client) -> None:
    store = await _store(nc, keep=2)
    payloads = {v: os.urandom(2 * CHUNK + v) for v in range(1, 5)}
    for version, payload in payloads.items():
        await store.put(version, payload)
    assert await store.versions() == [3, 4]
    assert await store.latest() == 4
    for gone in (1, 2):
        with pytest.raises(PayloadMissing):
            await store.get(gone)
    assert await store.get(3) == payloads[3] and await store.get(4) == payloads[4]
    state = (await nc.jetstream().stream_info(store.stream)).state
    assert state.messages == 2 * (3 + 1)  # two versions of 3 chunks + a manifest each


async def test_versions_above_the_one_put_do_not_purge_it(nc: Client) -> None:
    """Versions 5-6 stored by someone else (an earlier run's stream replayed into this one): the writer's put of
    version 1 keeps version 1, as it would in an empty store."""
    store = await _store(nc, keep=2)
    for version in (5, 6):
        await store.put(version, b"an earlier run's weights")
    await store.put(1, b"ours")
    assert await store.get(1) == b"ours"
    assert await store.versions() == [1, 5, 6]


async def test_interrupted_put_is_invisible_then_purged(nc: Client) -> None:
    store = await _store(nc, keep=1)
    js = nc.jetstream()
    await js.publish(store.chunk_subject(1), b"half of a payload")  # a put that died before its manifest
    assert await store.versions() == [] and await store.latest() is None
    with pytest.raises(PayloadMissing):
        await store.get(1)
    await store.put(2, b"v2")
    await js.publish(store.chunk_subject(3), b"put in progress")
    await store.put(4, b"v4")
    assert await store.versions() == [4]
    subjects = (await js.stream_info(store.stream, subjects_filter=">")).state.subjects or {}
    assert sorted(subjects) == [store.chunk_subject(4), store.meta_subject(4)]


async def test_put_again_replaces_the_version(nc: Client) -> None:
    store = await _store(nc)
    await store.put(1, os.urandom(3 * CHUNK))
    second = os.urandom(CHUNK + 3)
    info = await store.put(1, second)
    assert await store.get(1, info.digest) == second
    state = (await nc.jetstream().stream_info(store.stream)).state
    assert state.messages == info.chunks + 1


async def test_auto_falls_back_to_nats_py(nc: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await _store(nc, "auto")
    payload = os.urandom(dataplane.RAW_FETCH_MIN_BYTES + 7)  # large enough that auto tries the raw reader
    await store.put(1, payload)

    monkeypatch.setattr(dataplane, "endpoint_from_client", lambda _nc: None)  # e.g. a websocket URL
    assert await store.get(1) == payload

    def unreachable(_nc: Client) -> Endpoint:
        return Endpoint(host="127.0.0.1", port=1, tls=None, tls_hostname=None, auth=lambda info: {}, name="x")

    monkeypatch.setattr(dataplane, "endpoint_from_client", unreachable)
    assert await store.get(1) == payload
    raw = await _store(nc, "raw")
    with pytest.raises(BusError, match="cannot open weight-fetch connection"):
        await raw.get(1)


async def test_auto_reads_a_small_payload_through_the_shared_connection(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await _store(nc, "auto")
    small, large = os.urandom(dataplane.RAW_FETCH_MIN_BYTES - 1), os.urandom(dataplane.RAW_FETCH_MIN_BYTES)
    await store.put(1, small)
    await store.put(2, large)
    raw_reads: list[int] = []
    real = WeightStore._fetch_raw

    async def counted(self: WeightStore, endpoint: Endpoint, man: object, *args: object) -> None:
        raw_reads.append(man.version)  # type: ignore[attr-defined]
        await real(self, endpoint, man, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(WeightStore, "_fetch_raw", counted)
    assert await store.get(1) == small and await store.get(2) == large
    assert raw_reads == [2]  # no connection of its own for the small one


@pytest.mark.parametrize("fetch", FETCH_MODES)
async def test_get_into_a_reused_buffer(nc: Client, fetch: str) -> None:
    store = await _store(nc, fetch)
    payload = os.urandom(3 * CHUNK + 7)
    await store.put(1, payload)
    buf = bytearray(4 * CHUNK)
    got = await store.get(1, into=buf)
    assert got == payload and got.obj is buf  # written in place, no new allocation
    small = bytearray(10)
    other = await store.get(1, into=small)  # too small: a fresh buffer instead
    assert other == payload and other.obj is not small


async def test_memory_storage_and_a_later_actor_keeps_it(nc: Client) -> None:
    from nats.js.api import StorageType

    store = await WeightStore.create(nc.jetstream(), "t", chunk_bytes=CHUNK, storage="memory")
    payload = os.urandom(2 * CHUNK)
    await store.put(1, payload)
    later = await WeightStore.create(nc.jetstream(), "t", chunk_bytes=CHUNK)  # default storage="file"
    assert (await nc.jetstream().stream_info(store.stream)).config.storage == StorageType.MEMORY
    assert await later.get(1) == payload


def _make_certs(tmp: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (needs the openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True)

    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=miles-test-ca")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.ext",
    )
    return tmp / "ca.pem", tmp / "server.pem", tmp / "server.key"


async def test_raw_fetch_over_tls_with_password(tmp_path: Path) -> None:
    from miles.bus.connect import connect
    from miles.bus.server import EmbeddedNats

    ca, cert, key = _make_certs(tmp_path)
    extra = (
        f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}\n'
        'authorization {\n  user: "alice"\n  password: "s3cret"\n}\n'
    )
    async with EmbeddedNats(tmp_path / "bus", extra_config=extra) as srv:
        port = srv.url.rsplit(":", 1)[1]
        with pytest.raises(BusError):
            await connect(f"tls://127.0.0.1:{port}", name="t", tls_ca=str(ca), connect_attempts=2)  # no password
        client = await connect(f"tls://alice:s3cret@127.0.0.1:{port}", name="t", tls_ca=str(ca))
        try:
            store = await _store(client, "raw")
            payload = os.urandom(5 * CHUNK + 1)
            info = await store.put(1, payload)
            assert await store.get(1, info.digest) == payload
        finally:
            await client.close()
