"""Free TCP ports for servers and rendezvous on this host, chosen where nobody else will take them.

A port the kernel hands out (a bind to port 0, any outgoing connection's local port) comes from its
ephemeral range, so another socket can take it between our choosing it and the server binding it, and a
server restarted on its old port can find it taken by some connection's local end (a clean-clone CI run
failed on exactly that: "bind: address already in use"). A port below that range is only ever taken by a
process that asks for it by number, so that is where :func:`free_port` looks.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_LOW = 32768  # the kernel's default, and below macOS' 49152
LOWEST = 10000  # under this lie the well-known and registered services a host may run
TRIES = 200


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux' default where the file is missing)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now and lies below the ephemeral range."""
    high = ephemeral_low()
    low = min(LOWEST, high - 1024)
    for _ in range(TRIES):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue  # in use (or lingering): try another
            return port
    raise OSError(f"no free port on {host} in [{low}, {high}) after {TRIES} tries")
