"""Free ports are chosen below the kernel's ephemeral range, where no connection's local end can take them."""

import socket

import pytest

from miles import ports
from miles.ports import ephemeral_low, free_port


def test_a_free_port_lies_below_the_ephemeral_range_and_binds() -> None:
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        other = free_port()
        offers = iter([busy, other])
        monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(offers))
        assert free_port() == other


def test_the_range_falls_back_to_linux_default_without_proc(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ephemeral_low() == ports.LINUX_EPHEMERAL_LOW
