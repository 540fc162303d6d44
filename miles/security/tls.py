"""TLS material of a run: a private CA, the server's certificate and one client certificate per role.

Why mutual TLS on top of nkey logins: the nkey proves *which role* a client is; the client
certificate proves it holds material from this run's bundle at all, so a stolen seed alone is not
enough, and a client without a certificate never gets as far as the login. Encryption of the link
comes with it (announcements, prompts and weights cross data-centre networks and leaf links).

Keys are ECDSA P-256 (fast to make, accepted by every TLS stack nats-server and the clients use).
Every private key is written with mode 0600, by creating the file with that mode, so no other user
can read it even for an instant.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DAYS = 365
# Always in the server certificate, so the embedded server and tunnels on the same host verify.
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def write_secret(path: Path, data: bytes) -> None:
    """Write ``data`` to a new or existing file readable by its owner only (0600 from creation on)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
        os.write(fd, data)
    finally:
        os.close(fd)


def write_public(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o644)


@dataclass(frozen=True, slots=True)
class CertKey:
    """A certificate with its private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def write(self, cert_path: Path, key_path: Path) -> None:
        write_public(cert_path, self.cert_pem())
        write_secret(key_path, self.key_pem())


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Miles"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.timezone.utc)
    return now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)  # a little slack for clock skew


def make_ca(run: str, days: int = DEFAULT_DAYS) -> CertKey:
    """A CA that signs this run's server and client certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    name = _name(f"Miles run {run} CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertKey(cert=cert, key=key)


def load_ca(cert_file: Path, key_file: Path) -> CertKey:
    """An existing CA (e.g. the first run's ``ca/``), to issue the certificates of further runs that
    share a server: the server then trusts one CA, and every run's clients verify the same server."""
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_file} is not an EC private key")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
        raise ValueError(f"{key_file} is not the key of {cert_file}")
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    if not constraints.ca:
        raise ValueError(f"{cert_file} is not a CA certificate")
    return CertKey(cert=cert, key=key)


def _san(names: Iterable[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    seen: set[str] = set()
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _issue(
    ca: CertKey, common_name: str, usage: x509.ObjectIdentifier, days: int, names: Iterable[str] = ()
) -> CertKey:
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )
    names = list(names)
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return CertKey(cert=builder.sign(ca.key, hashes.SHA256()), key=key)


def make_server_cert(ca: CertKey, run: str, hostnames: Iterable[str] = (), days: int = DEFAULT_DAYS) -> CertKey:
    """The server's certificate, valid for localhost/127.0.0.1/::1 and ``hostnames`` (DNS names or IPs)."""
    return _issue(ca, f"Miles run {run} NATS server", ExtendedKeyUsageOID.SERVER_AUTH, days, [*LOCAL_NAMES, *hostnames])


def make_client_cert(ca: CertKey, run: str, role: str, days: int = DEFAULT_DAYS) -> CertKey:
    """A client certificate for ``role`` (common name ``<run>:<role>``, client authentication only)."""
    return _issue(ca, f"{run}:{role}", ExtendedKeyUsageOID.CLIENT_AUTH, days)


def render_tls_block(cert_file: Path, key_file: Path, ca_file: Path, *, timeout_s: float = 5.0) -> str:
    """The server's ``tls { }`` block: its certificate, and ``verify: true`` so that every client must
    present a certificate signed by the run's CA (mutual TLS)."""
    q = json.dumps
    return "\n".join(
        [
            "tls {",
            f"  cert_file: {q(str(cert_file))}",
            f"  key_file: {q(str(key_file))}",
            f"  ca_file: {q(str(ca_file))}",
            "  verify: true",
            f"  timeout: {timeout_s}",
            "}",
            "",
        ]
    )
