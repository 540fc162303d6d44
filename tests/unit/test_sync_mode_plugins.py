"""Sync modes registered by name: the built-ins' properties, a mode of your own from a recipe's ``plugins``, and
one-line errors for an unknown mode, an import path, or a config the mode cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config import ConfigError, load_config
from miles.plugins import PluginError
from miles.sync.modes import SYNC_MODES, DeltaMode, FullMode, LoraMode, sync_mode

MODULE = """
from miles.sync.modes import FullMode, register_sync_mode


@register_sync_mode("full_logged")
class FullLogged(FullMode):
    published: list[int] = []

    async def publish(self, sender, version, lineage):
        self.published.append(version)
        return await super().publish(sender, version, lineage)
"""


def test_the_built_in_modes_say_what_workers_and_stores_need() -> None:
    assert SYNC_MODES.names[:3] == ("full", "lora", "delta")
    full = sync_mode(load_config(None, []))
    assert isinstance(full, FullMode) and not full.uses_delta_store and full.worker_lora() is None
    delta = sync_mode(load_config(None, ["sync.mode=delta"]))
    assert isinstance(delta, DeltaMode) and delta.uses_delta_store and delta.worker_lora() is None
    lora_cfg = load_config(None, ["sync.mode=lora", "trainer.lora={rank: 4}"])
    lora = sync_mode(lora_cfg)
    assert isinstance(lora, LoraMode) and lora.worker_lora() == lora_cfg.trainer.lora


def test_a_mode_registered_by_a_plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "logged_mode.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["plugins=[logged_mode]", "sync.mode=full_logged", "sync.transport=fs"])
    mode = sync_mode(cfg)
    assert type(mode).__name__ == "FullLogged" and isinstance(mode, FullMode) and mode.any_transport


def test_a_mode_refuses_what_it_cannot_run_in_one_line() -> None:
    with pytest.raises(ConfigError, match="unknown sync mode 'nope'; known: full, lora, delta.* or one of your own"):
        load_config(None, ["sync.mode=nope"])
    with pytest.raises(ConfigError, match="sync.mode"):
        load_config(None, ["sync.mode=my.modes:Mine"])  # names only: the name travels in the run info
    with pytest.raises(PluginError, match="registered from a module in the recipe's plugins"):
        SYNC_MODES.factory("my.modes:Mine")
    with pytest.raises(ConfigError, match="sync.mode 'lora' needs trainer.lora"):
        load_config(None, ["sync.mode=lora"])
    with pytest.raises(ConfigError, match="sync.transport 'fs' carries full payloads: sync.mode 'delta' needs 'bus'"):
        load_config(None, ["sync.mode=delta", "sync.transport=fs"])
