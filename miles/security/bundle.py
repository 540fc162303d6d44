"""The credentials bundle of a run: what ``miles creds`` writes, and how an actor loads its part.

Layout (``<out>`` is e.g. ``runs/<run>/auth``; every directory holding a secret is 0700, every
secret 0600)::

    <out>/bundle.json              public facts: run, run nonce, account, user and signing public keys
    <out>/ca/ca.pem, ca-key.pem    the run's CA (keep the key offline: it only issues more certificates)
    <out>/server/server.conf       accounts + tls blocks, loadable as is (``include`` or extra_config)
    <out>/server/account.conf      the account alone, for a shared ``accounts { include ... }`` block
    <out>/server/tls.conf          the tls block alone
    <out>/server/server-cert.pem, server-key.pem, ca.pem
    <out>/fleets/<name>/           one per remote fleet: its leaf node's config (with the link's seed),
                                   link and server certificates; copy it to the fleet's server host
    <out>/<role>/                  one per role; copy only this directory to that role's hosts
        identity.json              run, run nonce, role, account, inbox prefix, public keys
        user.nk                    the role's login seed (nats-py ``nkeys_seed``)
        client-cert.pem, client-key.pem, ca.pem
        signing.pub                the trainer's public signing key (every role verifies with it)
        controller-signing.pub     the controller's public signing key (every role verifies with it)
        signing.nk                 trainer only: the trainer's signing seed
        controller-signing.nk      controller only: the controller's signing seed

The run nonce (128 random bits) names this *instance* of the run: it is part of every signed
message and every control command, so a new run under the same name needs a new bundle, and a restarted
run keeps its own.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import ssl
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from miles.security.fleet import (
    DEFAULT_HUB_DOMAIN,
    DEFAULT_LEAF_LISTEN,
    Fleet,
    render_hub_leafnodes,
    split_hub_urls,
    write_fleet,
)
from miles.security.identities import Identity, account_name, generate_identities, render_account, render_accounts
from miles.security.nkey import KeyPair, NkeyError
from miles.security.permissions import ROLES, Role, check_run_name, inbox_prefix
from miles.security.signing import MessageSigner, MessageVerifier, Signer
from miles.security.tls import (
    DEFAULT_DAYS,
    CertKey,
    load_ca,
    make_ca,
    make_client_cert,
    make_server_cert,
    render_tls_block,
    write_secret,
)

log = structlog.get_logger(__name__)

BUNDLE_FILE = "bundle.json"
IDENTITY_FILE = "identity.json"
BUNDLE_FORMAT = 1
# Signing role -> (public key file, seed file) in a role directory.
_SIGNING_FILES: dict[Signer, tuple[str, str]] = {
    "trainer": ("signing.pub", "signing.nk"),
    "controller": ("controller-signing.pub", "controller-signing.nk"),
}


class CredentialsError(Exception):
    """A bundle that cannot be written or loaded; the message is one line naming the problem."""


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    path.chmod(0o644)


def write_bundle(
    out: str | Path,
    run: str,
    *,
    hostnames: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
    server_dir: str | Path | None = None,
    fleet_dir: str | Path | None = None,
    ephemeral_consumers: bool = False,
    ca_dir: str | Path | None = None,
    fleets: Sequence[str] = (),
    hub_url: str = "tls://HUB-HOST:7422",
    hub_domain: str = DEFAULT_HUB_DOMAIN,
    leaf_listen: str = DEFAULT_LEAF_LISTEN,
    force: bool = False,
) -> Path:
    """Generate every identity, key and certificate of ``run`` into ``out``; returns ``out``.

    ``server_dir`` is where ``server/`` will live on the server host, written into the tls block's
    paths (default: where it is written now); ``fleet_dir`` likewise for each ``fleets/<name>/`` on its
    fleet's server (the paths in its ``leafnode.conf``). An existing bundle is only replaced with ``force``
    (which rotates every key: hand the new role directories out again). ``ca_dir`` reuses the CA of
    another bundle (its ``ca/`` directory) instead of making one, for runs that share a server.
    Each of ``fleets`` gets a leaf link (:mod:`miles.security.fleet`): the hub then listens for leaf
    nodes on ``leaf_listen`` and must run JetStream domain ``hub_domain``; fleets dial ``hub_url``.
    """
    check_run_name(run)
    out = Path(out).absolute()
    if (out / BUNDLE_FILE).exists() and not force:
        raise CredentialsError(f"{out} already holds a bundle (use --force to replace every key in it)")
    if days < 1:
        raise CredentialsError("certificate validity must be at least one day")
    if len(set(fleets)) != len(fleets):
        raise CredentialsError("fleet names must be distinct")
    if fleets:
        try:
            split_hub_urls(hub_url)
        except ValueError as exc:
            raise CredentialsError(f"--hub-url: {exc}") from None
    # Everything is made before anything is written: bad input leaves no half bundle behind.
    ca = _existing_ca(Path(ca_dir)) if ca_dir is not None else make_ca(run, days)
    server = make_server_cert(ca, run, hostnames, days)
    nonce = secrets.token_hex(16)
    identities = generate_identities(run, ephemeral_consumers=ephemeral_consumers)
    signing = {"trainer": KeyPair.generate("account"), "controller": KeyPair.generate("account")}
    links = [Fleet.generate(run, f, ca, hub_domain=hub_domain, hostnames=hostnames, days=days) for f in fleets]

    _private_dir(out)
    ca_out = _private_dir(out / "ca")
    ca.write(ca_out / "ca.pem", ca_out / "ca-key.pem")
    server_out = _private_dir(out / "server")
    server.write(server_out / "server-cert.pem", server_out / "server-key.pem")
    (server_out / "ca.pem").write_bytes(ca.cert_pem())
    where = Path(server_dir) if server_dir is not None else server_out
    files = (where / "server-cert.pem", where / "server-key.pem", where / "ca.pem")
    account = render_account(run, identities, extra=[link.link for link in links])
    tls_block = render_tls_block(*files)
    (server_out / "account.conf").write_text(account)
    (server_out / "tls.conf").write_text(tls_block)
    header = f"# Miles run {run!r}: NATS authorization and TLS, generated by `miles creds` (bundle {nonce[:8]}).\n"
    if links:
        header += f"# Fleets join through leaf nodes: this server needs `jetstream {{ domain: {hub_domain} }}`.\n"
    leafnodes = render_hub_leafnodes(*files, listen=leaf_listen) if links else ""
    (server_out / "server.conf").write_text(header + render_accounts(account) + tls_block + leafnodes)

    for role, identity in identities.items():
        _write_role(_private_dir(out / role), run, nonce, identity, signing, ca, days)
    rollout_key = identities["rollout"].keys.public_key
    for link in links:
        write_fleet(
            _private_dir(_private_dir(out / "fleets") / link.name),
            run,
            link,
            ca=ca,
            rollout_public_key=rollout_key,
            hub_url=hub_url,
            hub_domain=hub_domain,
            files_at=Path(fleet_dir) if fleet_dir is not None else None,
        )
    _write_json(
        out / BUNDLE_FILE,
        {
            "format": BUNDLE_FORMAT,
            "run": run,
            "run_nonce": nonce,
            "account": account_name(run),
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "hostnames": list(hostnames),
            "ephemeral_consumers": ephemeral_consumers,
            "signing_public_key": signing["trainer"].public_key,
            "controller_signing_public_key": signing["controller"].public_key,
            "users": {role: identity.keys.public_key for role, identity in identities.items()},
            "fleets": {link.name: link.link.keys.public_key for link in links},
            "hub_domain": hub_domain if links else None,
        },
    )
    log.info("credentials_written", run=run, out=str(out), roles=list(identities), fleets=list(fleets), nonce=nonce[:8])
    return out


def _write_role(
    role_dir: Path, run: str, nonce: str, identity: Identity, signing: dict[Signer, KeyPair], ca: CertKey, days: int
) -> None:
    role = identity.role
    write_secret(role_dir / "user.nk", (identity.keys.seed + "\n").encode())
    (role_dir / "user.pub").write_text(identity.keys.public_key + "\n")
    make_client_cert(ca, run, role, days).write(role_dir / "client-cert.pem", role_dir / "client-key.pem")
    (role_dir / "ca.pem").write_bytes(ca.cert_pem())
    for signer, key in signing.items():
        (role_dir / _SIGNING_FILES[signer][0]).write_text(key.public_key + "\n")
        if role == signer:
            write_secret(role_dir / _SIGNING_FILES[signer][1], (key.seed + "\n").encode())
    _write_json(
        role_dir / IDENTITY_FILE,
        {
            "format": BUNDLE_FORMAT,
            "run": run,
            "run_nonce": nonce,
            "role": role,
            "account": account_name(run),
            "inbox_prefix": inbox_prefix(run, role),
            "user_public_key": identity.keys.public_key,
            "signing_public_key": signing["trainer"].public_key,
            "controller_signing_public_key": signing["controller"].public_key,
        },
    )


def _existing_ca(ca_dir: Path) -> CertKey:
    try:
        return load_ca(ca_dir / "ca.pem", ca_dir / "ca-key.pem")
    except OSError as exc:
        raise CredentialsError(f"cannot read the CA in {ca_dir}: {exc.strerror}") from None
    except ValueError as exc:
        raise CredentialsError(f"cannot use the CA in {ca_dir}: {exc}") from None


def server_config(out: str | Path) -> str:
    """The text of ``<out>/server/server.conf`` (e.g. for ``EmbeddedNats(extra_config=...)``)."""
    path = Path(out) / "server" / "server.conf"
    try:
        return path.read_text()
    except OSError as exc:
        raise CredentialsError(f"cannot read {path}: {exc.strerror}") from None


# --------------------------------------------------------------------------- loading one role


def _check_private(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # A warning, not a refusal: secret volumes of some orchestrators are mounted group-readable.
        log.warning("credentials_file_not_private", path=str(path), mode=oct(stat.S_IMODE(mode)))


@dataclass(frozen=True, slots=True)
class RoleCredentials:
    """One role's part of a bundle, loaded from its directory."""

    directory: Path
    run: str
    run_nonce: str
    role: Role
    account: str
    inbox_prefix: str
    signing_public_key: str  # the trainer's
    controller_signing_public_key: str

    @classmethod
    def load(cls, directory: str | Path, role: Role | None = None) -> RoleCredentials:
        """Load ``directory`` (a role directory, or a bundle root together with ``role``).

        Raises :class:`CredentialsError` if files are missing, or if the directory is another role's.
        """
        path = Path(directory)
        if role is not None and not (path / IDENTITY_FILE).is_file() and (path / role / IDENTITY_FILE).is_file():
            path = path / role
        try:
            meta = json.loads((path / IDENTITY_FILE).read_text())
        except OSError:
            raise CredentialsError(f"no {IDENTITY_FILE} in {path} (generate a bundle with `miles creds`)") from None
        except ValueError as exc:
            raise CredentialsError(f"{path / IDENTITY_FILE} is not valid JSON: {exc}") from None
        if meta.get("format") != BUNDLE_FORMAT:
            raise CredentialsError(
                f"{path / IDENTITY_FILE} has format {meta.get('format')!r}, expected {BUNDLE_FORMAT}"
            )
        if role is not None and meta.get("role") != role:
            raise CredentialsError(f"{path} holds the credentials of role {meta.get('role')!r}, not {role!r}")
        creds = cls(
            directory=path.absolute(),
            run=meta["run"],
            run_nonce=meta["run_nonce"],
            role=meta["role"],
            account=meta["account"],
            inbox_prefix=meta["inbox_prefix"],
            signing_public_key=meta["signing_public_key"],
            controller_signing_public_key=meta["controller_signing_public_key"],
        )
        for name in ("user.nk", "client-cert.pem", "client-key.pem", "ca.pem"):
            if not (creds.directory / name).is_file():
                raise CredentialsError(f"{creds.directory / name} is missing")
        _check_private(creds.seed_file)
        _check_private(creds.key_file)
        return creds

    @property
    def seed_file(self) -> Path:
        return self.directory / "user.nk"

    @property
    def cert_file(self) -> Path:
        return self.directory / "client-cert.pem"

    @property
    def key_file(self) -> Path:
        return self.directory / "client-key.pem"

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    def ssl_context(self) -> ssl.SSLContext:
        """Client TLS: verify the server against the run's CA, present this role's certificate."""
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca_file))
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(certfile=str(self.cert_file), keyfile=str(self.key_file))
        except (ssl.SSLError, OSError) as exc:
            raise CredentialsError(f"cannot load the TLS material in {self.directory}: {exc}") from None
        return ctx

    def nats_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.aio.client.Client.connect`` that log in as this role."""
        return {"nkeys_seed": str(self.seed_file), "tls": self.ssl_context(), "inbox_prefix": self.inbox_prefix}

    def verifier(self) -> MessageVerifier:
        """Verifies the trainer's and the controller's signed messages of this run instance."""
        keys: dict[Signer, str] = {"trainer": self.signing_public_key, "controller": self.controller_signing_public_key}
        return MessageVerifier.from_nkeys(keys, run=self.run, run_nonce=self.run_nonce)

    def signer(self) -> MessageSigner:
        """This role's signer (trainer or controller); :class:`CredentialsError` for a role that signs nothing."""
        if self.role not in _SIGNING_FILES:
            raise CredentialsError(f"role {self.role!r} signs nothing (only the trainer and the controller do)")
        signer: Signer = self.role  # type: ignore[assignment]
        public_name, seed_name = _SIGNING_FILES[signer]
        path = self.directory / seed_name
        if not path.is_file():
            raise CredentialsError(f"{path} is missing (the {signer}'s directory holds its signing seed)")
        _check_private(path)
        try:
            key = KeyPair.from_seed(path.read_text(), "account")
        except NkeyError as exc:
            raise CredentialsError(f"{path}: {exc}") from None
        expected = self.signing_public_key if signer == "trainer" else self.controller_signing_public_key
        if key.public_key != expected:
            raise CredentialsError(f"{path} does not match the {signer} signing public key of {IDENTITY_FILE}")
        return MessageSigner(key=key, signer=signer, run=self.run, run_nonce=self.run_nonce)


def load_role(directory: str | Path, role: Role) -> RoleCredentials:
    """Shorthand for :meth:`RoleCredentials.load` with the role checked."""
    if role not in ROLES:
        raise CredentialsError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    return RoleCredentials.load(directory, role)
