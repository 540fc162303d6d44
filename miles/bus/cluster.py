"""A JetStream cluster of ``nats-server`` processes on one host: for tests, benchmarks and trying a cluster out.

:class:`NatsCluster` starts ``size`` :class:`~miles.bus.server.EmbeddedNats` nodes that route to each other
(``cluster { routes }``) on fixed loopback ports, so a node that is killed (:meth:`NatsCluster.kill`) comes
back on the same URL (:meth:`NatsCluster.restart`) with its JetStream store as it was on disk, as a real node
that crashed and was restarted by its supervisor. :attr:`NatsCluster.url` lists every node, comma-separated:
what ``--nats-url`` takes for a cluster (the client moves to another node when its own goes away).

The configs are the ones deploy/nats/cluster-node.conf documents for separate hosts; only the host and
the ports differ.
"""

from __future__ import annotations

import threading
from pathlib import Path

from miles.bus.server import DEFAULT_MAX_PAYLOAD, EmbeddedNats
from miles.ports import free_port


def cluster_block(name: str, listen_port: int, route_ports: list[int], host: str = "127.0.0.1") -> str:
    routes = ", ".join(f'"nats-route://{host}:{p}"' for p in route_ports)
    return f'cluster {{\n  name: "{name}"\n  listen: "{host}:{listen_port}"\n  routes: [{routes}]\n}}\n'


class NatsCluster:
    """``size`` routed nats-servers with JetStream under ``root`` (one directory per node)."""

    def __init__(
        self,
        root: str | Path,
        *,
        size: int = 3,
        name: str = "miles",
        extra_config: str = "",
        js_domain: str | None = None,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        scheme: str = "nats",
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        self.root = Path(root)
        self.name = name
        self.scheme = scheme
        self.client_ports = [free_port() for _ in range(size)]
        self.route_ports = [free_port() for _ in range(size)]
        self.nodes = [
            EmbeddedNats(
                self.root / f"node{i}",
                port=self.client_ports[i],
                server_name=f"{name}-{i}",
                max_payload=max_payload,
                js_domain=js_domain,
                start_timeout_s=60.0,
                extra_config=cluster_block(name, self.route_ports[i], self.route_ports) + extra_config,
            )
            for i in range(size)
        ]

    def node_url(self, i: int) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_ports[i]}"

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated."""
        return ",".join(self.node_url(i) for i in range(len(self.nodes)))

    def start(self) -> NatsCluster:
        """Start every node at once (JetStream is ready only when a majority is up) and wait for all."""
        for node in self.nodes:
            node._spawn()
        errors: list[BaseException] = []

        def wait(node: EmbeddedNats) -> None:
            try:
                node._wait_ready()
            except BaseException as exc:  # re-raised below, after every node was waited for
                errors.append(exc)

        threads = [threading.Thread(target=wait, args=(n,)) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise errors[0]
        return self

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``."""
        self.nodes[i].kill()

    def restart(self, i: int) -> None:
        """Start node ``i`` again (same ports, same store) and wait until it serves JetStream."""
        self.nodes[i].start_sync()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop_sync()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
