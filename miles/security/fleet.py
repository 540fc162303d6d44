"""A remote rollout fleet behind a leaf node: the hub-side identity of its link, and its server config.

A fleet on another site (another cluster, a cloud, a third party) runs its own nats-server as a leaf
node of the run's hub: its workers connect locally, and one outbound connection carries everything
to the hub. What may cross is decided on the hub, by the permissions of the leaf link's user, not
by the fleet's server: even a fleet whose own server lets its clients publish anything cannot get an
announcement, a weight chunk, a stop or a metric into the run (``tests/integration/test_permissions_fleet.py``).

How JetStream crosses (verified against nats-server 2.15): the hub has a JetStream domain
(``jetstream { domain: hub }``), the fleet's server has no JetStream and maps its clients' plain
``$JS.API...`` requests into that domain (``default_js_domain``), so Miles clients need no change.
The hub sees ``$JS.<domain>.API...`` on the link, checks the link's permissions on those subjects,
and only tells the fleet about API subjects it may use; so the link's permissions are the rollout
role's with the API subjects domain-prefixed (:func:`miles.security.permissions.with_js_domain`).

Inside the fleet, workers log in with the run's ordinary ``rollout/`` credentials: the generated
config lists the rollout user with the rollout permissions (API subjects domain-prefixed too: the
fleet's server checks them after ``default_js_domain`` has rewritten them), and its TLS trusts the
run's CA.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.security.identities import Identity, account_name
from miles.security.nkey import KeyPair
from miles.security.permissions import RUN_NAME, role_permissions, with_js_domain
from miles.security.tls import CertKey, make_client_cert, make_server_cert, render_tls_block, write_secret

DEFAULT_HUB_DOMAIN = "hub"
DEFAULT_LEAF_LISTEN = "0.0.0.0:7422"
DEFAULT_MAX_PAYLOAD = "8MB"


def check_fleet_name(name: str) -> str:
    if not RUN_NAME.match(name):
        raise ValueError(f"fleet name {name!r} must match [A-Za-z0-9_-]+")
    return name


@dataclass(frozen=True, slots=True)
class Fleet:
    """One fleet's link: the leaf's login key, its certificates, and the hub-side identity."""

    name: str
    link: Identity  # the hub account's user for this fleet's leaf connection
    link_cert: CertKey  # client certificate of the leaf connection to the hub
    server_cert: CertKey  # the fleet's own server, for its local workers

    @classmethod
    def generate(
        cls, run: str, name: str, ca: CertKey, *, hub_domain: str, hostnames: Sequence[str], days: int
    ) -> Fleet:
        check_fleet_name(name)
        link = Identity(
            role="rollout",
            keys=KeyPair.generate("user"),
            permissions=with_js_domain(role_permissions(run, "rollout"), hub_domain),
            label=f"fleet {name} (leaf link, rollout permissions)",
        )
        return cls(
            name=name,
            link=link,
            link_cert=make_client_cert(ca, run, f"fleet-{name}", days),
            server_cert=make_server_cert(ca, run, hostnames, days),
        )


def split_hub_urls(hub_url: str) -> list[str]:
    """The hub's leaf URLs, comma-separated (a cluster's nodes); ValueError for an empty entry."""
    urls = [u.strip() for u in hub_url.split(",")]
    if not all(urls):
        raise ValueError(f"hub URL list {hub_url!r} has an empty entry")
    return urls


def render_hub_leafnodes(cert_file: Path, key_file: Path, ca_file: Path, listen: str = DEFAULT_LEAF_LISTEN) -> str:
    """The hub's ``leafnodes { }`` block: where fleets dial in, with mutual TLS against the run's CA.
    Leaf links log in as users of the run's account (the fleets' link users)."""
    tls = "\n".join("  " + line for line in render_tls_block(cert_file, key_file, ca_file).splitlines())
    return f"leafnodes {{\n  listen: {json.dumps(listen)}\n{tls}\n}}\n"


def render_leaf_config(
    run: str,
    fleet_dir: Path,
    *,
    link_seed: str,
    rollout_public_key: str,
    hub_url: str,
    hub_domain: str,
    listen: str | None = "0.0.0.0:4222",
) -> str:
    """The fleet server's config (``listen=None`` leaves out listen and max_payload, for an embedded
    server that sets them itself). It holds the link's seed: the file is written 0600."""
    account = account_name(run)
    # checked after default_js_domain has prefixed the API subjects, like the hub's check of the link
    permissions = with_js_domain(role_permissions(run, "rollout"), hub_domain).as_config()
    user = json.dumps({"nkey": rollout_public_key, "permissions": permissions})
    q = json.dumps
    hub_urls = split_hub_urls(hub_url)
    # Several URLs (every node of a hub cluster): the leaf dials another when its node goes away.
    where = f"url: {q(hub_urls[0])}" if len(hub_urls) == 1 else f"urls: {json.dumps(hub_urls)}"
    remote_tls = (
        f"tls: {{ cert_file: {q(str(fleet_dir / 'link-cert.pem'))}, key_file: {q(str(fleet_dir / 'link-key.pem'))}, "
        f"ca_file: {q(str(fleet_dir / 'ca.pem'))} }}"
    )
    lines = [
        f"# Leaf node of a rollout fleet of Miles run {run!r}, generated by `miles creds`. Holds a secret: keep 0600.",
        "# Workers here connect to this server with the run's rollout/ credentials; it has no JetStream and",
        f"# sends their JetStream requests to the hub's domain {hub_domain!r}.",
    ]
    if listen is not None:
        lines += [f"listen: {q(listen)}", f"max_payload: {DEFAULT_MAX_PAYLOAD}", "max_pending: 128MB"]
    lines += [
        f"default_js_domain: {{ {q(account)}: {q(hub_domain)} }}",
        f"accounts {{\n  {q(account)}: {{\n    users: [\n      {user}\n    ]\n  }}\n}}",
        render_tls_block(fleet_dir / "server-cert.pem", fleet_dir / "server-key.pem", fleet_dir / "ca.pem").rstrip(),
        "leafnodes {",
        "  remotes: [",
        f"    {{ {where}, account: {q(account)}, nkey: {q(link_seed)}, {remote_tls} }}",
        "  ]",
        "}",
        "",
    ]
    return "\n".join(lines)


def write_fleet(
    fleet_dir: Path,
    run: str,
    fleet: Fleet,
    *,
    ca: CertKey,
    rollout_public_key: str,
    hub_url: str,
    hub_domain: str,
    files_at: Path | None = None,
) -> None:
    """Write one fleet's directory: its leaf config (0600), link and server certificates, the CA.
    ``files_at``: where the directory will live on the fleet's server (the config's paths; default: here)."""
    fleet.link_cert.write(fleet_dir / "link-cert.pem", fleet_dir / "link-key.pem")
    fleet.server_cert.write(fleet_dir / "server-cert.pem", fleet_dir / "server-key.pem")
    (fleet_dir / "ca.pem").write_bytes(ca.cert_pem())
    write_secret(fleet_dir / "link.nk", (fleet.link.keys.seed + "\n").encode())
    text = render_leaf_config(
        run,
        files_at if files_at is not None else fleet_dir,
        link_seed=fleet.link.keys.seed,
        rollout_public_key=rollout_public_key,
        hub_url=hub_url,
        hub_domain=hub_domain,
    )
    write_secret(fleet_dir / "leafnode.conf", text.encode())


def leaf_config_for(bundle: Path, name: str, *, hub_url: str, listen: str | None = "0.0.0.0:4222") -> str:
    """Render a written fleet's leaf config again, e.g. with the hub's real URL."""
    meta = json.loads((bundle / "bundle.json").read_text())
    if name not in (meta.get("fleets") or {}):
        raise ValueError(f"{bundle} has no fleet {name!r}")
    fleet_dir = bundle / "fleets" / name
    return render_leaf_config(
        meta["run"],
        fleet_dir.absolute(),
        link_seed=(fleet_dir / "link.nk").read_text().strip(),
        rollout_public_key=meta["users"]["rollout"],
        hub_url=hub_url,
        hub_domain=meta["hub_domain"],
        listen=listen,
    )
