"""Several server URLs wherever a URL is taken: checked when given, tried in turn when connecting."""

import subprocess
import sys
from pathlib import Path

import pytest

from miles.bus.connect import connect
from miles.bus.errors import BusError
from miles.bus.urls import split_urls
from miles.config import ConfigError, load_config
from miles.ports import free_port  # nothing listens there


def test_split_urls_takes_a_cluster_list() -> None:
    assert split_urls(" nats://a:4222, tls://b:4223 ,c:4224,") == ["nats://a:4222", "tls://b:4223", "c:4224"]


@pytest.mark.parametrize(
    ("url", "names"),
    [("nats://a:4222,http://b:80", "'http://b:80'"), ("nats://a:99999", "'nats://a:99999'"), (" , ", "no NATS")],
)
def test_a_bad_entry_is_named(url: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        split_urls(url)
    with pytest.raises(ConfigError, match="bus.nats_url"):
        load_config(None, [f"bus.nats_url={url}"])


def test_miles_node_refuses_a_bad_url_with_exit_2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "miles.node", "--role", "rollout", "--run-dir", str(tmp_path)]
    proc = subprocess.run([*cmd, "--nats-url", "nats://a:1,ftp://b"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "miles-node: error: --nats-url: NATS URL 'ftp://b': scheme must be one of nats, tls, ws, wss"
    )


def test_miles_node_takes_bus_nats_url_when_no_flag_is_given(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles.node",
            "--role",
            "rollout",
            "--run-dir",
            str(tmp_path),
            "--set",
            f"bus.nats_url={url}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"miles-node: error: cannot connect to NATS at {url}")


async def test_connect_skips_a_node_that_is_down(nats_server: str) -> None:
    nc = await connect(f"nats://127.0.0.1:{free_port()},{nats_server}", name="two-urls")
    try:
        assert nc.is_connected and nc.connected_url is not None
        assert f"{nc.connected_url.hostname}:{nc.connected_url.port}" in nats_server
    finally:
        await nc.close()


async def test_connect_refuses_a_bad_entry() -> None:
    with pytest.raises(BusError, match="'nats://x:0x'"):
        await connect("nats://x:0x", name="bad")
