"""The one HTTP client Miles uses to talk to inference servers (SGLang, vLLM, an SGLang teacher).

JSON over HTTP/1.1 keep-alive, to one server per client. Generation is the hot path: a rollout worker keeps
hundreds of requests in flight and its own CPU also plays the episodes, so the async side is aiohttp (a C
HTTP parser, a connection pool that does not rescan itself per request): at 256 requests in flight it spends
~0.25 ms of CPU per request where httpx spent ~5 ms (``benchmarks/server_client.py``). Control calls that
come from threads with no event loop (SGLang's weight endpoints from a staging thread, the trainer's
distributed update) take the blocking side, which holds its own keep-alive connection.

Errors, the same for every server and both sides (each names the server, the method and the path):

* :class:`ServerUnreachable`: no connection could be made (the server is not there);
* :class:`ConnectionLost`: the connection failed or dropped mid-request (the server may be going down,
  or only closed a keep-alive connection): a caller that owns the server decides whether to resend;
* ``refused`` (the client's error class, :class:`ServerError` by default): an HTTP status >= 400, a reply
  that is not JSON, a timeout.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp
import httpx

from miles.engines.base import EngineError

# Servers (uvicorn under vLLM and SGLang) close an idle keep-alive connection after 5 s; dropping ours
# sooner keeps a request from being written into a connection the server is closing.
KEEPALIVE_S = 3.0


class ServerError(EngineError):
    """An inference server refused a request or answered outside its contract (one-line message).

    ``status`` and ``body`` are the HTTP reply's, when there was one (a server's error body can say more
    than the message keeps: vLLM names a dead engine there)."""

    status: int | None = None
    body: str = ""


class ConnectionLost(ServerError):
    """The connection to the server failed or dropped before a reply came."""


class ServerUnreachable(ConnectionLost):
    """No connection to the server could be made."""


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line, at most ``limit`` characters (server error bodies can be whole tracebacks)."""
    return " ".join(text.split())[:limit]


class ServerClient:
    """JSON calls to one inference server at ``base_url``; async (:meth:`call`) and blocking (:meth:`call_blocking`).

    The async session opens on the first call, bound to that event loop; :meth:`close` closes both sides,
    after which the client may be used again. ``max_connections`` bounds the requests on the wire; more wait
    for a free connection with no timeout (the server's own queue is the one that matters).
    """

    def __init__(
        self,
        base_url: str,
        *,
        server: str,
        timeout_s: float,
        max_connections: int = 512,
        refused: type[ServerError] = ServerError,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.server = server
        self.timeout_s = float(timeout_s)
        self.max_connections = int(max_connections)
        self.refused = refused
        self._session: aiohttp.ClientSession | None = None
        self._blocking: httpx.Client | None = None
        self._blocking_lock = threading.Lock()

    # ------------------------------------------------------------------ async side

    def _open(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None or session.closed:
            session = self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
                ),
                # Per read, not per request: a long generation is fine as long as the server answers.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s),
                trust_env=False,  # a local server is never reached through a proxy
                auto_decompress=False,
            )
        return session

    async def call(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
        expect_json: bool = True,
    ) -> Any:
        """One request; the reply's JSON (None for an empty body), or its text with ``expect_json=False`` (some
        endpoints answer plain text). Raises the errors in the module docstring."""
        session = self._open()
        data = None if json_body is None else json.dumps(json_body, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json"} if data is not None else None
        timeout = None if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with session.request(
                method, self.base_url + path, data=data, params=params, headers=headers, timeout=timeout
            ) as response:
                status, body = response.status, await response.read()
        except (TimeoutError, asyncio.TimeoutError):
            raise self.refused(f"{method} {path}: no reply from {self.server} within the timeout") from None
        except aiohttp.ClientConnectorError as exc:
            raise ServerUnreachable(f"{method} {path}: cannot reach {self.server} at {self.base_url}: {exc}") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            raise ConnectionLost(f"{method} {path}: {type(exc).__name__}: {one_line(str(exc))}") from None
        except aiohttp.ClientError as exc:
            raise self.refused(f"{method} {path}: {type(exc).__name__}: {one_line(str(exc))}") from None
        return self._decode(method, path, status, body, expect_json)

    async def healthy(self, path: str = "/health", timeout_s: float = 5.0) -> bool:
        """Whether the server answers ``GET path`` with 200 within ``timeout_s``."""
        try:
            async with self._open().get(
                self.base_url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError):
            return False

    async def reopen(self, base_url: str) -> None:
        """Point the client at ``base_url`` (a restarted server), dropping every pooled connection."""
        await self.close()
        self.base_url = base_url.rstrip("/")

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        self.close_blocking()

    async def __aenter__(self) -> ServerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ blocking side

    def call_blocking(self, method: str, path: str, *, json_body: Any = None) -> Any:
        """:meth:`call` for a thread with no event loop (any thread; calls share one keep-alive connection pool)."""
        with self._blocking_lock:
            if self._blocking is None:
                self._blocking = httpx.Client(base_url=self.base_url, timeout=self.timeout_s, trust_env=False)
            client = self._blocking
        try:
            response = client.request(method, path, json=json_body)
        except httpx.TimeoutException:
            raise self.refused(f"{method} {path}: no reply from {self.server} within the timeout") from None
        except httpx.ConnectError as exc:
            raise ServerUnreachable(f"{method} {path}: cannot reach {self.server} at {self.base_url}: {exc}") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise ConnectionLost(f"{method} {path}: {type(exc).__name__}: {one_line(str(exc))}") from None
        except httpx.HTTPError as exc:
            raise self.refused(f"{method} {path}: {type(exc).__name__}: {one_line(str(exc))}") from None
        return self._decode(method, path, response.status_code, response.content)

    def close_blocking(self) -> None:
        with self._blocking_lock:
            client, self._blocking = self._blocking, None
        if client is not None:
            client.close()

    # ------------------------------------------------------------------ replies

    def _decode(self, method: str, path: str, status: int, body: bytes, expect_json: bool = True) -> Any:
        if status >= 400:
            text = body.decode(errors="replace")
            error = self.refused(f"{method} {path} -> HTTP {status}: {one_line(text)}")
            error.status, error.body = status, text[:4096]
            raise error
        if not expect_json:
            return body.decode(errors="replace")
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:
            text = body.decode(errors="replace")
            raise self.refused(f"{method} {path}: response is not JSON: {one_line(text, 200)!r}") from None
