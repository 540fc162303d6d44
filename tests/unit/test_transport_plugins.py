"""A weight transport of your own: both sides registered by name from a module the recipe's ``plugins`` imports;
no list of transport names is closed in the config, and a name with no side registered fails prepare's check."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config import ConfigError, load_config
from miles.plugins import PluginError
from miles.sync.receiver import RECEIVER_TRANSPORTS, ReceiverSide, check_transport
from miles.sync.sender import TRANSPORTS

MODULE = """
from miles.sync.receiver import ReceiverSide, register_receiver
from miles.sync.sender import register_transport
from miles.sync.transport.bus import BusTransport


@register_transport("carrier_pigeon")  # the bus under another name: enough to show the seam
async def sender(ctx):
    return BusTransport(ctx.store)


@register_receiver("carrier_pigeon")
async def receiver(ctx):
    return ReceiverSide()
"""


def test_a_transport_registered_by_a_plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pigeon_transport.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["plugins=[pigeon_transport]", "sync.transport=carrier_pigeon"])
    assert cfg.sync.transport == "carrier_pigeon"
    check_transport("carrier_pigeon")
    assert "carrier_pigeon" in TRANSPORTS.names and "carrier_pigeon" in RECEIVER_TRANSPORTS.names


def test_an_unknown_transport_or_plugin_is_one_line() -> None:
    with pytest.raises(PluginError, match="unknown weight transport 'pigeons'; known: bus, fs, broadcast"):
        check_transport("pigeons")
    with pytest.raises(ConfigError, match="plugins: cannot import module 'no_such_module'"):
        load_config(None, ["plugins=[no_such_module]"])
    with pytest.raises(ConfigError, match="sync.transport"):
        load_config(None, ["sync.transport=Not-A-Name"])
    assert ReceiverSide().source is None
