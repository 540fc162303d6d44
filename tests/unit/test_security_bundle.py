"""The bundle on disk: layout, file modes, loading a role, and the one-line CLI."""

from __future__ import annotations

import json
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from miles.security.bundle import CredentialsError, RoleCredentials, load_role, server_config, write_bundle
from miles.security.cli import main_creds
from miles.security.config import BusSecurityFields, resolve_credentials
from miles.security.permissions import ROLES
from miles.security.signing import SignatureError

RUN = "b1"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bundle(tmp_path_factory.mktemp("b") / "auth", RUN, hostnames=["nats.example.org", "10.1.2.3"])


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secrets_are_private_and_each_signer_alone_holds_its_seed(bundle: Path) -> None:
    assert mode(bundle) == 0o700
    assert mode(bundle / "ca" / "ca-key.pem") == 0o600
    assert mode(bundle / "server" / "server-key.pem") == 0o600
    for role in ROLES:
        assert mode(bundle / role) == 0o700
        assert mode(bundle / role / "user.nk") == 0o600
        assert mode(bundle / role / "client-key.pem") == 0o600
        assert (bundle / role / "signing.nk").exists() == (role == "trainer")
        assert (bundle / role / "controller-signing.nk").exists() == (role == "controller")
    assert mode(bundle / "trainer" / "signing.nk") == 0o600
    assert mode(bundle / "controller" / "controller-signing.nk") == 0o600
    assert not list((bundle / "rollout").glob("*ca-key*"))


def test_role_directories_are_self_contained_and_agree(bundle: Path) -> None:
    meta = json.loads((bundle / "bundle.json").read_text())
    for role in ROLES:
        creds = load_role(bundle, role)
        assert (creds.run, creds.role, creds.run_nonce) == (RUN, role, meta["run_nonce"])
        assert creds.signing_public_key == meta["signing_public_key"]
        assert creds.controller_signing_public_key == meta["controller_signing_public_key"]
        assert (creds.directory / "user.pub").read_text().strip() == meta["users"][role]
        assert meta["users"][role] in server_config(bundle)
        assert (creds.directory / "user.nk").read_text().strip() not in server_config(bundle)  # public keys only
        options = creds.nats_options()
        assert options["inbox_prefix"] == f"_INBOX.{RUN}.{role}" and isinstance(options["tls"], ssl.SSLContext)
    assert len(set(meta["users"].values())) == len(ROLES)


def test_certificates_name_the_server_and_the_roles(bundle: Path) -> None:
    server = x509.load_pem_x509_certificate((bundle / "server" / "server-cert.pem").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "nats.example.org"}
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1", "10.1.2.3"}
    client = x509.load_pem_x509_certificate((bundle / "rollout" / "client-cert.pem").read_bytes())
    assert f"CN={RUN}:rollout" in client.subject.rfc4514_string()
    usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_each_signer_matches_every_roles_verifier(bundle: Path) -> None:
    subject, payload = f"{RUN}.events.weights", b"\x82\xa4kind\xa1x"
    for signer in ("trainer", "controller"):
        headers = load_role(bundle, signer).signer().headers(subject, payload)
        for role in ROLES:
            verifier = load_role(bundle, role).verifier()
            verifier.verify(subject, payload, headers, signer)
            with pytest.raises(SignatureError):  # the other signer's key does not verify it
                verifier.verify(subject, payload, headers, "controller" if signer == "trainer" else "trainer")
    for role in ("rollout", "monitor", "setup"):
        with pytest.raises(CredentialsError, match="signs nothing"):
            load_role(bundle, role).signer()


def test_loading_the_wrong_directory_is_one_clear_error(bundle: Path, tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match="role 'rollout', not 'trainer'"):
        RoleCredentials.load(bundle / "rollout", "trainer")
    with pytest.raises(CredentialsError, match="miles creds"):
        RoleCredentials.load(tmp_path, "rollout")
    with pytest.raises(CredentialsError, match="unknown role"):
        load_role(bundle, "admin")  # type: ignore[arg-type]


def test_an_existing_bundle_is_kept_unless_forced(tmp_path: Path) -> None:
    out = write_bundle(tmp_path / "auth", RUN)
    nonce = json.loads((out / "bundle.json").read_text())["run_nonce"]
    with pytest.raises(CredentialsError, match="already holds"):
        write_bundle(out, RUN)
    write_bundle(out, RUN, force=True)
    assert json.loads((out / "bundle.json").read_text())["run_nonce"] != nonce


def test_cli_writes_a_bundle_and_reports_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "auth"
    assert main_creds(["--run", RUN, "--out", str(out), "--hostname", "h1"]) == 0
    assert (out / "server" / "server.conf").is_file()
    capsys.readouterr()
    for argv in (
        [],
        ["--run", "a b"],
        ["--run", RUN, "--out", str(out)],
        ["--run", RUN, "--out", str(tmp_path / "x"), "--days", "0"],
        ["--run", RUN, "--out", str(tmp_path / "y"), "--ca-dir", str(tmp_path / "nope")],
        ["--run", RUN, "--days", "soon"],
    ):
        assert main_creds(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("miles creds: "), err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_config_fields_resolve_the_actors_identity(bundle: Path) -> None:
    assert resolve_credentials(BusSecurityFields(), "rollout") is None
    cfg = BusSecurityFields(credentials_dir=str(bundle))
    assert cfg.require_signatures and not cfg.payload_sha256
    creds = resolve_credentials(cfg, "rollout")
    assert creds is not None and creds.role == "rollout"
    setup = resolve_credentials(BusSecurityFields(credentials_dir=str(bundle), role="setup"), "controller")
    assert setup is not None and setup.role == "setup"
    with pytest.raises(ValueError):
        BusSecurityFields(credentials_dir=str(bundle), role="admin")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BusSecurityFields(surprise=1)  # type: ignore[call-arg]


def test_config_refuses_two_ways_to_log_in(bundle: Path) -> None:
    class MergedBusConfig(BusSecurityFields):  # as BusConfig will be
        creds: str | None = None

    with pytest.raises(ValueError, match="replaces bus.creds"):
        MergedBusConfig(credentials_dir=str(bundle), creds="x.creds")
    MergedBusConfig(creds="x.creds")


def test_miles_creds_is_a_miles_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`miles creds ...`, as the README and docs/security.md write it (it was documented but not wired)."""
    from miles.cli import build_parser, main

    assert "creds" in build_parser().format_help()
    out = tmp_path / "auth"
    assert main(["creds", "--run", RUN, "--out", str(out), "--hostname", "h1"]) == 0
    assert (out / "trainer").is_dir() and (out / "server" / "server.conf").is_file()
    capsys.readouterr()
    assert main(["creds", "--run", RUN, "--out", str(out)]) == 2  # exists: refused, one line
    assert capsys.readouterr().err.startswith("miles creds: ")
