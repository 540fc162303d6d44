"""The OpenAI-compatible chat endpoint a rollout worker serves to black-box agents (docs/agents.md, "Agents
of your own").

One small HTTP/1.1 server per worker process (asyncio and h11, bound to 127.0.0.1), started on first use. Each
episode opens a :class:`Session` under a random path, ``http://127.0.0.1:<port>/agent/<key>/v1``: an agent
written against any OpenAI-compatible client takes that as its base URL. ``POST .../chat/completions`` hands
the request's messages to the session and answers with the completion the episode runner sampled for them
(:class:`miles.rollout.agent_env.AgentEnv`); ``GET .../models`` names the one model. Nothing here touches
tokens: the episode runner owns them, as for every environment.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
import structlog

log = structlog.get_logger(__name__)

MODEL_NAME = "miles-policy"
MAX_BODY_BYTES = 16 << 20


class CallRefused(Exception):
    """A call the episode cannot take (it ended, or the history was rewritten): HTTP ``status`` with ``reason``."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


Handler = Callable[[list[dict[str, str]]], Awaitable[tuple[str, str]]]  # messages -> (text, finish_reason)


@dataclass(slots=True)
class Session:
    """One episode's endpoint: ``base_url`` for the agent, ``handler`` for its calls."""

    key: str
    base_url: str
    handler: Handler


class AgentServer:
    """The per-process endpoint: sessions by key, one asyncio server."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._server: asyncio.Server | None = None
        self._port = 0
        self._starting = asyncio.Lock()

    async def open(self, handler: Handler) -> Session:
        """A new session whose calls go to ``handler``; the server starts on first use."""
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
                self._port = self._server.sockets[0].getsockname()[1]
                log.info("agent_endpoint_started", port=self._port)
        key = secrets.token_urlsafe(12)
        session = Session(key, f"http://127.0.0.1:{self._port}/agent/{key}/v1", handler)
        self._sessions[key] = session
        return session

    def close(self, session: Session) -> None:
        self._sessions.pop(session.key, None)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = await _read_request(conn, reader)
                if request is None:
                    return
                status, payload = await self._route(request, body)
                data = json.dumps(payload).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
                writer.write(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
                writer.write(conn.send(h11.Data(data=data)) or b"")
                writer.write(conn.send(h11.EndOfMessage()) or b"")
                await writer.drain()
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (h11.RemoteProtocolError, ConnectionError, asyncio.IncompleteReadError) as exc:
            log.debug("agent_endpoint_connection_closed", error=str(exc))
        finally:
            writer.close()

    async def _route(self, request: h11.Request, body: bytes) -> tuple[int, dict[str, Any]]:
        parts = request.target.decode("latin-1").split("?")[0].strip("/").split("/")
        if len(parts) < 4 or parts[0] != "agent" or parts[2] != "v1":
            return 404, _error("not found: /agent/<key>/v1/chat/completions")
        session = self._sessions.get(parts[1])
        if session is None:
            return 404, _error("no such episode (it ended, or the key is wrong)")
        route = "/".join(parts[3:])
        if request.method == b"GET" and route == "models":
            return 200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "miles"}]}
        if request.method != b"POST" or route != "chat/completions":
            return 404, _error(f"not served: {request.method.decode()} /{route}")
        try:
            messages = _messages(json.loads(body or b"{}"))
        except (ValueError, TypeError) as exc:
            return 400, _error(f"bad request: {exc}")
        try:
            text, finish = await session.handler(messages)
        except CallRefused as exc:
            return exc.status, _error(str(exc))
        return 200, _completion(text, finish)


async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader) -> tuple[h11.Request | None, bytes]:
    """The next request and its body, or ``(None, b"")`` when the client closed the connection."""
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            chunk = await reader.read(65536)
            conn.receive_data(chunk)
            if not chunk and request is None:
                return None, b""
            continue
        if isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY_BYTES:
                raise h11.RemoteProtocolError("request body too large")
        elif isinstance(event, h11.EndOfMessage):
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None, b""


def _messages(request: Any) -> list[dict[str, str]]:
    """The chat messages of a request, as ``{"role", "content"}`` with text content (parts of type ``text``
    joined); a malformed list is a ValueError naming the message."""
    messages = request.get("messages") if isinstance(request, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is rendered
            texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = "".join(texts)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be text")
        out.append({"role": message["role"], "content": content})
    return out


def _completion(text: str, finish: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{secrets.token_hex(8)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
    }


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}


_SERVERS: dict[asyncio.AbstractEventLoop, AgentServer] = {}


def agent_server() -> AgentServer:
    """This event loop's endpoint (one per rollout worker: it runs one loop)."""
    loop = asyncio.get_running_loop()
    for old in [known for known in _SERVERS if known.is_closed()]:
        del _SERVERS[old]
    return _SERVERS.setdefault(loop, AgentServer())
