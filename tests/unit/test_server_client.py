"""ServerClient, the one HTTP client for inference servers: the same replies and failures on its async and
blocking sides, against a real local HTTP server."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles.engines.server_client import ConnectionLost, ServerClient, ServerError, ServerUnreachable
from miles.ports import free_port


class Refused(ServerError):
    pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._reply(200 if self.path == "/health" else 404, b"")

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/echo":
            self._reply(200, json.dumps({"got": json.loads(body)}).encode())
        elif self.path == "/empty":
            self._reply(200, b"")
        elif self.path == "/dead":
            self._reply(500, b'{"error": "EngineDeadError: the engine core died"}')
        elif self.path == "/html":
            self._reply(200, b"<html>not json</html>")
        else:  # /drop: the connection closes with no reply
            self.close_connection = True


@pytest.fixture
def url() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


async def test_both_sides_answer_the_same_and_fail_the_same(url: str) -> None:
    async with ServerClient(url, server="test server", timeout_s=5.0, refused=Refused) as client:
        for call in (
            lambda path, body=None: client.call("POST", path, json_body=body),
            lambda path, body=None: _done(client.call_blocking("POST", path, json_body=body)),
        ):
            assert await call("/echo", {"ids": [1, 2]}) == {"got": {"ids": [1, 2]}}
            assert await call("/empty") is None
            with pytest.raises(Refused, match=r"POST /dead -> HTTP 500: .*EngineDead") as dead:
                await call("/dead")
            assert dead.value.status == 500 and "engine core died" in dead.value.body
            with pytest.raises(Refused, match="POST /html: response is not JSON"):
                await call("/html")
            with pytest.raises(ConnectionLost) as lost:
                await call("/drop")
            assert not isinstance(lost.value, ServerUnreachable)
        assert await client.healthy() and not await client.healthy("/missing")


async def _done(value: object) -> object:
    return value


async def test_a_server_that_is_not_there_is_unreachable_on_both_sides() -> None:
    async with ServerClient(f"http://127.0.0.1:{free_port()}", server="nobody", timeout_s=5.0) as client:
        with pytest.raises(ServerUnreachable, match="cannot reach nobody"):
            await client.call("POST", "/generate", json_body={})
        with pytest.raises(ServerUnreachable, match="cannot reach nobody"):
            client.call_blocking("GET", "/health")
        assert not await client.healthy()


async def test_reopen_points_the_client_at_a_restarted_server(url: str) -> None:
    async with ServerClient(f"http://127.0.0.1:{free_port()}", server="test server", timeout_s=5.0) as client:
        assert not await client.healthy()
        await client.reopen(url)
        assert await client.healthy()
        assert await client.call("POST", "/echo", json_body=1) == {"got": 1}
