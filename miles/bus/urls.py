"""NATS server URLs as Miles takes them: one, or several comma-separated (the nodes of a cluster).

The client connects to the first that answers and, when its server goes away, reconnects to another
of the list (and to the nodes the cluster itself advertises). Giving every node matters at start-up:
an actor started while the one node it was told of is down cannot connect at all.

Torch- and nats-free, so that the config can check ``bus.nats_url`` when it is loaded.
"""

from __future__ import annotations

from urllib.parse import urlsplit

SCHEMES = ("nats", "tls", "ws", "wss")


def split_urls(url: str) -> list[str]:
    """The server URLs in ``url`` (``"nats://a:4222,nats://b:4222"``), each checked: a known scheme, a host
    and a valid port. Raises :class:`ValueError` naming the entry that is wrong."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no NATS server URL in {url!r}")
    for server in servers:
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        if parts.scheme not in SCHEMES:
            raise ValueError(f"NATS URL {server!r}: scheme must be one of {', '.join(SCHEMES)}")
        try:
            port = parts.port  # raises for a port out of range or not a number
        except ValueError:
            port = -1
        if not parts.hostname or port == -1:
            raise ValueError(f"NATS URL {server!r}: expected scheme://host[:port]")
    return servers
