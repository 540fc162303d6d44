"""Who gets in at all: mutual TLS against the run's CA, then an nkey login of the run's account.

A client without credentials, with a certificate from another CA, without a certificate, or with a
login key of another bundle is turned away by the server; a client that does not trust the run's CA
refuses the server. Also: the generated ``server.conf`` passes ``nats-server -t``, and two runs'
accounts share one server through ``include``.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from miles.bus.server import EmbeddedNats, find_nats_server
from miles.security.bundle import RoleCredentials, server_config, write_bundle

RUN = "sec"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The run's bundle, and an unrelated one (same run name, other keys and CA)."""
    root = tmp_path_factory.mktemp("auth")
    return write_bundle(root / "ours", RUN), write_bundle(root / "theirs", RUN)


@pytest.fixture
async def server(tmp_path: Path, bundles: tuple[Path, Path]) -> AsyncIterator[EmbeddedNats]:
    async with EmbeddedNats(tmp_path / "bus", extra_config=server_config(bundles[0])) as srv:
        yield srv


@pytest.fixture
def url(server: EmbeddedNats) -> str:
    return server.url


async def server_log(server: EmbeddedNats, waiting_for: str, timeout_s: float = 5.0) -> str:
    """The server's log once it holds ``waiting_for``, or after ``timeout_s``: the server writes why it refused
    a client after closing the connection, so the client can see the refusal before the line is written."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        text = server.log_path.read_text(errors="replace")
        if waiting_for in text or loop.time() > deadline:
            return text
        await asyncio.sleep(0.05)


async def try_connect(url: str, **options: Any) -> str | None:
    """``None`` if the connection is accepted, otherwise the error the client saw."""
    errors: list[str] = []

    async def error_cb(exc: Exception) -> None:
        errors.append(f"{type(exc).__name__}: {exc}")

    nc = Client()
    try:
        await nc.connect(
            servers=[url],
            allow_reconnect=False,
            max_reconnect_attempts=1,
            connect_timeout=3,
            error_cb=error_cb,
            **options,
        )
    except Exception as exc:  # nats-py raises auth errors, SSL errors, NoServersError...
        return errors[-1] if errors else f"{type(exc).__name__}: {exc}"
    await nc.close()
    return None


def tls_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


async def test_each_role_logs_in_with_its_own_credentials(url: str, bundles: tuple[Path, Path]) -> None:
    for role in ("setup", "controller", "trainer", "rollout", "monitor"):
        assert await try_connect(url, **RoleCredentials.load(bundles[0], role).nats_options()) is None, role


def insecure_context() -> ssl.SSLContext:
    """What an intruder would use: TLS without verifying the server and without a certificate."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def test_a_client_without_credentials_cannot_connect(
    server: EmbeddedNats, url: str, bundles: tuple[Path, Path]
) -> None:
    assert await try_connect(url, tls=insecure_context()) is not None
    expected = "client didn't provide a certificate"
    assert expected in await server_log(server, expected)
    ours = RoleCredentials.load(bundles[0], "rollout")
    # TLS right but no login: the account has no anonymous user
    error = await try_connect(url, tls=ours.ssl_context())
    assert error is not None and "authorization" in error.lower()


async def test_a_client_certificate_from_another_ca_cannot_connect(
    server: EmbeddedNats, url: str, bundles: tuple[Path, Path]
) -> None:
    ours, theirs = RoleCredentials.load(bundles[0], "rollout"), RoleCredentials.load(bundles[1], "rollout")
    wrong_cert = tls_context(ours.ca_file, theirs.cert_file, theirs.key_file)
    assert await try_connect(url, tls=wrong_cert, nkeys_seed=str(ours.seed_file)) is not None
    expected = "certificate signed by unknown authority"
    assert expected in await server_log(server, expected)
    no_cert = tls_context(ours.ca_file)
    assert await try_connect(url, tls=no_cert, nkeys_seed=str(ours.seed_file)) is not None


async def test_a_login_key_of_another_bundle_cannot_connect(
    server: EmbeddedNats, url: str, bundles: tuple[Path, Path]
) -> None:
    ours, theirs = RoleCredentials.load(bundles[0], "trainer"), RoleCredentials.load(bundles[1], "trainer")
    error = await try_connect(url, tls=ours.ssl_context(), nkeys_seed=str(theirs.seed_file))
    assert error is not None and "authorization" in error.lower()
    expected = f'authentication error - Nkey "{theirs.directory.joinpath("user.pub").read_text().strip()}"'
    assert expected in await server_log(server, expected)


async def test_the_client_refuses_a_server_it_cannot_verify(url: str, bundles: tuple[Path, Path]) -> None:
    ours, theirs = RoleCredentials.load(bundles[0], "rollout"), RoleCredentials.load(bundles[1], "rollout")
    trusting_another_ca = tls_context(theirs.ca_file, ours.cert_file, ours.key_file)
    error = await try_connect(url, tls=trusting_another_ca, nkeys_seed=str(ours.seed_file))
    assert error is not None and "certificate" in error.lower()


def test_generated_server_config_passes_nats_server_check(bundles: tuple[Path, Path]) -> None:
    conf = bundles[0] / "server" / "server.conf"
    result = subprocess.run(
        [str(find_nats_server()), "-c", str(conf), "-t"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr or result.stdout


async def test_two_runs_share_one_server_through_included_accounts(tmp_path: Path) -> None:
    a = write_bundle(tmp_path / "a", "run-a")
    b = write_bundle(tmp_path / "b", "run-b", ca_dir=a / "ca")  # one CA: the server and both runs trust it
    nats_dir = tmp_path / "bus" / "nats"  # include paths resolve against the config file's directory
    nats_dir.mkdir(parents=True)
    for name, bundle in (("a", a), ("b", b)):
        (nats_dir / f"account-{name}.conf").write_text((bundle / "server" / "account.conf").read_text())
    accounts = 'accounts {\n  include "account-a.conf"\n  include "account-b.conf"\n}\n'
    async with EmbeddedNats(tmp_path / "bus", extra_config=accounts + (a / "server" / "tls.conf").read_text()) as srv:
        setups = {}
        for run, bundle in (("run-a", a), ("run-b", b)):
            nc = Client()
            await nc.connect(
                servers=[srv.url], allow_reconnect=False, **RoleCredentials.load(bundle, "setup").nats_options()
            )
            setups[run] = nc
        await setups["run-b"].jetstream().add_stream(name="run-b_PROMPTS", subjects=["run-b.prompts"])
        # accounts isolate: run a's administrator does not even see run b's stream
        assert await setups["run-a"].jetstream().streams_info() == []
        for nc in setups.values():
            await nc.close()
