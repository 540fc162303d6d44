"""Connecting an actor to NATS with the options every Miles process wants.

Why these options:

* The first connect fails fast with a one-line :class:`BusError` naming the URL: an actor that cannot
  reach the bus at start-up is misconfigured, and a stack of retries hides that.
* Once connected, reconnects never give up (``max_reconnect_attempts`` is lifted to -1): a restarting server or a
  blip on the network should pause the actors, not kill them. JetStream makes the work durable.
* ``pending_size`` is raised so that weight chunks of up to 64 MB can be buffered while the client
  is reconnecting and so that large publishes are not force-flushed one by one.
* Connection events are logged through structlog instead of nats-py's default ``print``-like callbacks.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client

from miles.bus.errors import BusError
from miles.bus.retry import Outage
from miles.bus.urls import split_urls

log = structlog.get_logger(__name__)

MiB = 1024 * 1024


def make_ssl_context(tls_ca: str | None, tls_cert: str | None, tls_key: str | None) -> ssl.SSLContext | None:
    """A client TLS context verifying the server (against ``tls_ca`` or the system store), with a client
    certificate for mutual TLS when ``tls_cert``/``tls_key`` are given; ``None`` when no option is set."""
    if not (tls_ca or tls_cert or tls_key):
        return None
    if bool(tls_cert) != bool(tls_key):
        raise BusError("mutual TLS needs both bus.tls_cert and bus.tls_key")
    for label, path in (("tls_ca", tls_ca), ("tls_cert", tls_cert), ("tls_key", tls_key)):
        if path and not Path(path).is_file():
            raise BusError(f"bus.{label} file not found: {path}")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls_ca)
        if tls_cert and tls_key:
            ctx.load_cert_chain(certfile=tls_cert, keyfile=tls_key)
    except (ssl.SSLError, OSError) as exc:
        raise BusError(f"cannot load TLS material: {exc}") from None
    return ctx


async def connect(
    url: str,
    *,
    name: str,
    creds: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    connect_timeout_s: float = 5.0,
    connect_attempts: int = 3,
    extra_options: dict[str, Any] | None = None,
    outage: Outage | None = None,
) -> Client:
    """Connect to ``url`` (comma-separated URLs for a cluster) as client ``name``.

    The first connection tries each server ``connect_attempts`` times (at least twice, 0.5 s apart);
    after that the client reconnects forever. Raises :class:`BusError` with a one-line message if no
    server can be reached or the server refuses us. ``extra_options`` (a role's login: nkey seed, TLS
    context, inbox prefix) are passed to nats-py as they are.
    """
    if creds and not Path(creds).is_file():
        raise BusError(f"bus.creds file not found: {creds}")
    tls = make_ssl_context(tls_ca, tls_cert, tls_key)
    try:
        servers = split_urls(url)
    except ValueError as exc:
        raise BusError(str(exc)) from None
    connected = False
    first_errors: list[Exception] = []

    async def error_cb(exc: Exception) -> None:
        # Before the first successful connect nats-py reports every failed attempt here; keep the last
        # one for the BusError instead of logging each.
        if not connected:
            first_errors.append(exc)
        else:
            log.warning("nats_error", client=name, error=f"{type(exc).__name__}: {exc}")

    async def disconnected_cb() -> None:
        if connected and not nc.is_closed:  # close() reports a disconnect too; that one is expected
            log.warning("nats_disconnected", client=name)
            if outage is not None:
                outage.disconnected()

    async def reconnected_cb() -> None:
        if outage is not None:
            outage.reconnected()
        log.info("nats_reconnected", client=name, url=str(nc.connected_url.geturl()) if nc.connected_url else None)

    async def closed_cb() -> None:
        log.debug("nats_closed", client=name)

    options: dict[str, Any] = dict(
        servers=servers,
        name=name,
        connect_timeout=connect_timeout_s,
        allow_reconnect=True,
        # nats-py applies this limit to the first connect too (-1 would retry forever there), so start
        # finite and lift it once connected.
        # (0 would mean "no limit" to nats-py, hence at least 2 tries per server).
        max_reconnect_attempts=max(1, connect_attempts - 1),
        reconnect_time_wait=0.5,
        ping_interval=10,
        max_outstanding_pings=3,
        pending_size=128 * MiB,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
        closed_cb=closed_cb,
    )
    if creds:
        options["user_credentials"] = creds
    if tls is not None:
        options["tls"] = tls
    options.update(extra_options or {})
    nc = Client()
    try:
        await nc.connect(**options)
    except Exception as exc:  # nats-py raises NoServersError, OSError, TimeoutError, auth errors...
        cause = first_errors[-1] if first_errors else exc
        detail = str(cause) or type(cause).__name__
        raise BusError(f"cannot connect to NATS at {url}: {detail}") from None
    nc.options["max_reconnect_attempts"] = -1
    connected = True
    log.debug("nats_connected", client=name, url=str(nc.connected_url.geturl()) if nc.connected_url else url)
    return nc


async def close_client(nc: Client) -> None:
    """Close ``nc``: drained (what is buffered is sent first) when connected; when the server is away (an actor
    giving up past its outage budget) closed at once, dropping the buffer. nats-py's ``drain`` refuses a
    reconnecting client and its ``close`` raises writing that buffer to the dead socket, either of which would
    hide the error that ends the actor; a JetStream publish in that buffer was never acked, so nothing that
    was confirmed is lost."""
    if nc.is_closed:
        return
    if nc.is_connected:
        await nc.drain()
        return
    log.info("nats_closing_while_disconnected", dropped_bytes=nc._pending_data_size)
    nc._pending, nc._pending_data_size = [], 0  # nats-py keeps no public way to drop its reconnect buffer
    await nc.close()


async def processed(nc: Client) -> None:
    """Return once the server has processed every command ``nc`` sent before this call (a subscription is
    registered, a publish routed or refused). nats-py's ``flush`` alone does not promise that: it writes its
    PING straight to the socket, ahead of the commands still in its pending buffer, so the PONG can answer
    before a SUB is read (a request from another connection then found "no responders", 9 times in 2,000
    here). By the time that first PONG is back, the flusher has written the buffer, so the second PING
    follows every earlier command on the wire."""
    await nc.flush()
    await nc.flush()


__all__ = ["BusError", "close_client", "connect", "make_ssl_context", "processed"]
