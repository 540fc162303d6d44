"""A fleet's leaf config for a hub cluster, the deploy/ NATS configs, and the heartbeat subjects a hub-side
reader needs for a remote fleet (tests/integration/test_bus_leaf.py runs them for real)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from miles.actors.trust import ROLES
from miles.bus.server import find_nats_server
from miles.bus.subjects import Subjects
from miles.security.bundle import write_bundle
from miles.security.fleet import leaf_config_for

DEPLOY_NATS = Path(__file__).resolve().parents[2] / "deploy" / "nats"


def nats_server_accepts(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(find_nats_server()), "-t", "-c", str(path)], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bundle(tmp_path_factory.mktemp("auth") / "auth", "r", fleets=["cloud"])


def test_a_fleet_dials_every_hub_node_it_is_given(bundle: Path, tmp_path: Path) -> None:
    urls = ["tls://a:7422", "tls://b:7422", "tls://c:7422"]
    text = leaf_config_for(bundle, "cloud", hub_url=" , ".join(urls))
    assert 'urls: ["tls://a:7422", "tls://b:7422", "tls://c:7422"]' in text
    path = tmp_path / "leaf.conf"
    path.write_text(text)
    result = nats_server_accepts(path)
    assert result.returncode == 0, result.stdout + result.stderr
    single = leaf_config_for(bundle, "cloud", hub_url=urls[0])
    assert 'url: "tls://a:7422"' in single and "urls:" not in single


def test_an_empty_hub_url_entry_is_refused(bundle: Path) -> None:
    with pytest.raises(ValueError, match="empty entry"):
        leaf_config_for(bundle, "cloud", hub_url="tls://a:7422,,tls://b:7422")


@pytest.mark.parametrize("name", ["single.conf", "cluster-node.conf", "hub-node.conf", "leafnode.conf"])
def test_deploy_nats_configs_load(name: str) -> None:
    result = nats_server_accepts(DEPLOY_NATS / name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_heartbeat_readers_subscribe_once_per_role() -> None:
    subjects = Subjects("r").heartbeats(ROLES)
    assert "r.hb.rollout.*" in subjects and len(subjects) == len(ROLES)
    assert "r.hb.*.*" not in subjects  # a hub would send a fleet's leaf node no interest in it


def test_miles_creds_refuses_an_empty_hub_url_entry_before_writing_anything(tmp_path: Path) -> None:
    from miles.security.cli import main_creds

    out = tmp_path / "auth"
    assert main_creds(["--run", "r", "--out", str(out), "--fleet", "cloud", "--hub-url", "tls://a:7422,"]) == 2
    assert not out.exists()


def test_a_fleet_config_names_its_files_where_they_will_live(tmp_path: Path) -> None:
    """--fleet-dir: the leaf config's certificate paths are the fleet server's, not the bundle's; the config,
    copied there with its directory, loads in nats-server."""
    from miles.security.cli import main_creds

    out, there = tmp_path / "auth", tmp_path / "etc" / "miles-fleet"
    argv = ["--run", "r", "--out", str(out), "--fleet", "cloud", "--hub-url", "tls://hub:7422"]
    assert main_creds([*argv, "--fleet-dir", str(there)]) == 0
    conf = (out / "fleets" / "cloud" / "leafnode.conf").read_text()
    assert f'"{there}/link-cert.pem"' in conf and f'"{there}/server-key.pem"' in conf and str(out) not in conf
    there.parent.mkdir(parents=True)
    (out / "fleets" / "cloud").rename(there)  # what the docs say to do on the fleet's server
    result = nats_server_accepts(there / "leafnode.conf")
    assert result.returncode == 0, result.stderr + result.stdout
