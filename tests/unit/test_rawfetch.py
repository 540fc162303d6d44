"""The raw direct-get reader's protocol parsing, fed byte streams split at every awkward place."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import pytest

from miles.bus.errors import BusError, ChecksumMismatch, PayloadMissing
from miles.sync.checksum import digest, hasher
from miles.sync.transport.dataplane import _Manifest, _ranges, _version_of
from miles.sync.transport.rawfetch import (
    ChunkMissing,
    ChunkRequest,
    _Connection,
    _DirectGet,
    _parse_headers,
    endpoint_from_client,
)

SUBJECT = "run.weights.3.chunk"
INBOX = b"_INBOX.abc"


class FakeTransport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _reply(index: int, payload: bytes, *, subject: str = SUBJECT, status: str = "") -> bytes:
    if status:
        hdr = f"NATS/1.0 {status}\r\n\r\n".encode()
    else:
        hdr = f"NATS/1.0\r\nNats-Stream: S\r\nNats-Subject: {subject}\r\nNats-Sequence: {index + 10}\r\n\r\n".encode()
    line = b"HMSG %s.%d 1 %d %d\r\n" % (INBOX, index, len(hdr), len(hdr) + len(payload))
    return line + hdr + payload + b"\r\n"


def _feed(conn: _Connection, data: bytes, rng: random.Random, max_step: int) -> None:
    pos = 0
    while pos < len(data):
        buf = conn.get_buffer(-1)
        n = min(len(buf), len(data) - pos, rng.randint(1, max_step))
        buf[:n] = data[pos : pos + n]
        conn.buffer_updated(n)
        pos += n


def _setup(sizes: list[int]) -> tuple[_Connection, _DirectGet, bytearray, FakeTransport]:
    conn = _Connection()
    transport = FakeTransport()
    conn.transport = transport  # type: ignore[assignment]
    requests, offset = [], 0
    for i, size in enumerate(sizes):
        requests.append(ChunkRequest(seq=i + 10, offset=offset, length=size))
        offset += size
    dest = bytearray(offset)
    getter = _DirectGet(
        conn,
        request_subject=b"$JS.API.DIRECT.GET.S",
        inbox=INBOX,
        subject=SUBJECT,
        requests=requests,
        dest=memoryview(dest),
        window=2,
    )
    conn.handler = getter
    getter.start()
    return conn, getter, dest, transport


@pytest.mark.parametrize("max_step", [1, 7, 300, 1 << 20])
async def test_parser_reassembles_any_split(max_step: int) -> None:
    rng = random.Random(max_step)
    sizes = [5000, 1, 0, 70_000, 300_000, 12]
    payloads = [rng.randbytes(n) for n in sizes]
    conn, getter, dest, transport = _setup(sizes)
    assert transport.written.count(b"PUB ") == 2  # the window
    stream = b'INFO {"server_id":"x"}\r\n+OK\r\nPING\r\n'
    for i in (1, 0, 3, 2, 5, 4):  # replies may come in any order
        stream += _reply(i, payloads[i])
        if i == 3:
            stream += b"PING\r\n"
    _feed(conn, stream, rng, max_step)
    assert getter.done.done() and getter.done.exception() is None
    assert bytes(dest) == b"".join(payloads)
    assert transport.written.count(b"PONG\r\n") == 2
    assert transport.written.count(b"PUB ") == len(sizes)
    assert b'{"seq":15}' in transport.written


async def test_not_found_status() -> None:
    conn, getter, _, _ = _setup([10, 10])
    _feed(conn, _reply(0, b"", status="404 Message Not Found"), random.Random(0), 5)
    with pytest.raises(ChunkMissing) as info:
        getter.done.result()
    assert isinstance(info.value, PayloadMissing) and info.value.seq == 10


async def test_wrong_subject_and_size() -> None:
    conn, getter, _, _ = _setup([10])
    _feed(conn, _reply(0, b"x" * 10, subject="run.weights.2.chunk"), random.Random(0), 64)
    with pytest.raises(ChecksumMismatch, match="holds"):
        getter.done.result()
    conn, getter, _, _ = _setup([10])
    _feed(conn, _reply(0, b"x" * 11), random.Random(0), 64)
    with pytest.raises(ChecksumMismatch, match="11 bytes"):
        getter.done.result()


async def test_server_error_and_lost_connection() -> None:
    conn, getter, _, _ = _setup([10])
    _feed(conn, b"-ERR 'Authorization Violation'\r\n", random.Random(0), 64)
    with pytest.raises(BusError, match="Authorization Violation"):
        getter.done.result()
    conn, getter, _, _ = _setup([10])
    conn.connection_lost(None)
    with pytest.raises(BusError, match="closed"):
        getter.done.result()
    await asyncio.sleep(0)


def test_parse_headers() -> None:
    assert _parse_headers(b"NATS/1.0 404 Message Not Found\r\n\r\n") == (404, "Message Not Found", {})
    code, _, headers = _parse_headers(b"NATS/1.0\r\nNats-Subject: a.b\r\nX: 1:2\r\n\r\n")
    assert code == 0 and headers == {"Nats-Subject": "a.b", "X": "1:2"}


def _client(url: str, **options: Any) -> Any:
    opts = {"user": None, "password": None, "token": None, "name": "w1"} | options
    return SimpleNamespace(connected_url=urlparse(url), options=opts, _signature_cb=None, _user_jwt_cb=None)


def test_endpoint_follows_the_client() -> None:
    ep = endpoint_from_client(_client("nats://alice:s3cret@10.0.0.5:4333"))
    assert ep is not None and (ep.host, ep.port, ep.tls, ep.name) == ("10.0.0.5", 4333, None, "w1:weights")
    assert ep.auth({}) == {"user": "alice", "pass": "s3cret"}
    ep = endpoint_from_client(_client("nats://127.0.0.1:4222", token="tok"))
    assert ep is not None and ep.auth({}) == {"auth_token": "tok"}
    ep = endpoint_from_client(_client("tls://example.org:4222"))
    assert ep is not None and ep.tls is not None
    signed = _client("nats://127.0.0.1:4222")
    signed._signature_cb = lambda nonce: b"sig-" + nonce.encode()
    signed._user_jwt_cb = lambda: b"jwt"
    ep = endpoint_from_client(signed)
    assert ep is not None and ep.auth({"nonce": "n1"}) == {"sig": "sig-n1", "jwt": "jwt"}
    assert endpoint_from_client(_client("ws://127.0.0.1:8080")) is None
    assert endpoint_from_client(_client("nats://127.0.0.1:4222", tls_handshake_first=True)) is None


def test_manifest_and_subject_helpers() -> None:
    assert _ranges([5, 6, 7, 10, 11, 13]) == [(5, 3), (10, 2), (13, 1)]
    man = _Manifest(version=3, size=25, chunk_bytes=10, digest=digest(b"x"), seqs=[(5, 2), (9, 1)])
    again = _Manifest.decode(man.encode())
    assert again == man and again.chunks == 3
    assert [(r.seq, r.offset, r.length) for r in again.requests()] == [(5, 0, 10), (6, 10, 10), (9, 20, 5)]
    with pytest.raises(BusError, match="inconsistent"):
        _Manifest.decode(_Manifest(version=3, size=25, chunk_bytes=10, digest="d", seqs=[(5, 2)]).encode())
    assert _version_of("run.weights.12.meta") == 12 and _version_of("run.weights.x.meta") is None


def test_checksum_is_xxh3_128_and_incremental() -> None:
    assert digest(b"") == "99aa06d3014798d86001c324468d497f"
    assert digest(b"abc") == digest(bytearray(b"abc")) == digest(memoryview(b"abc"))
    h = hasher()
    for part in (b"ab", b"", b"c"):
        h.update(part)
    assert h.hexdigest() == digest(b"abc") and len(digest(b"abc")) == 32


async def test_requests_lost_with_a_replica_are_sent_again_and_a_second_answer_is_dropped() -> None:
    """A direct get taken by a replica that then went down is never answered: the fetch sends again what is in
    flight; the first answer is placed, a late second one dropped, and each chunk counted once."""
    conn, getter, dest, transport = _setup([10, 10, 10])
    assert transport.written.count(b"PUB ") == 2  # window 2: chunks 0 and 1 in flight
    rng = random.Random(0)
    _feed(conn, _reply(1, b"b" * 10), rng, 7)  # chunk 0's request was lost; chunk 2's goes out
    assert getter.resend() == 2  # chunks 0 and 2, nothing answered yet
    assert transport.written.count(b'{"seq":10}') == 2 and transport.written.count(b'{"seq":11}') == 1
    _feed(conn, _reply(0, b"a" * 10), rng, 7)
    _feed(conn, _reply(2, b"c" * 10), rng, 7)
    assert getter.done.done() and getter.done.exception() is None
    _feed(conn, _reply(2, b"X" * 10), rng, 7)  # the second answer of a re-sent request
    assert bytes(dest) == b"a" * 10 + b"b" * 10 + b"c" * 10 and getter.completed == 3


async def test_a_server_gone_during_the_handshake_is_a_bus_error() -> None:
    """A node killed between its INFO and our CONNECT: a BusError (the data plane falls back), not uvloop's
    RuntimeError of a write on a closed transport, which killed a worker."""
    from miles.sync.transport.rawfetch import Endpoint, _open

    async def info_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"x","max_payload":1048576}\r\n')
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(info_then_close, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for _ in range(5):  # whichever the loop sees first, the INFO or the close, the answer is a BusError
            endpoint = Endpoint("127.0.0.1", port, None, None, lambda info: {}, "t")
            with pytest.raises(BusError):
                await _open(endpoint, b"_INBOX.t", 2.0)
    finally:
        server.close()
        await server.wait_closed()
