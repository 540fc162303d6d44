"""``miles creds``: generate the identities, keys and certificates of a run.

miles creds --run myrun --out runs/myrun/auth --hostname nats-a.example.org --hostname 10.0.0.5
miles creds --run myrun --fleet cloud --hub-url tls://nats-a.example.org:7422   # plus a leaf-node fleet

Writes the bundle described in :mod:`miles.security.bundle` and prints where each part goes. Bad
input is one line on stderr and exit status 2; nothing is written then.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles.security.bundle import CredentialsError, write_bundle
from miles.security.fleet import DEFAULT_HUB_DOMAIN, DEFAULT_LEAF_LISTEN
from miles.security.permissions import ROLES, check_run_name
from miles.security.tls import DEFAULT_DAYS


class UsageError(Exception):
    """A bad command line (argparse's own report is a usage block; ours is one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def build_parser(prog: str = "miles creds") -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        description="Generate per-role NATS identities, TLS certificates and the trainer's and the controller's "
        "signing keys for a run.",
    )
    p.add_argument("--run", required=True, help="Run name (the recipe's `name:`), [A-Za-z0-9_-]+.")
    p.add_argument("--out", help="Bundle directory (default: runs/<run>/auth).")
    p.add_argument(
        "--hostname",
        action="append",
        default=[],
        metavar="H",
        help="DNS name or IP clients use to reach the server (repeatable); localhost/127.0.0.1/::1 are always in.",
    )
    p.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"Certificate validity (default {DEFAULT_DAYS}).")
    p.add_argument(
        "--server-dir",
        help="Where server/ will live on the server host (paths in server.conf's tls block; default: where written).",
    )
    p.add_argument(
        "--fleet-dir",
        help="Where fleets/NAME/ will live on each fleet's server (paths in its leafnode.conf; default: where "
        "written), e.g. /etc/nats/miles-fleet.",
    )
    p.add_argument(
        "--ca-dir",
        help="Issue certificates with an existing bundle's CA (its ca/ directory): runs that share one server.",
    )
    p.add_argument(
        "--fleet",
        action="append",
        default=[],
        metavar="NAME",
        help="A remote rollout fleet joining through a leaf node (repeatable): writes fleets/NAME/leafnode.conf.",
    )
    p.add_argument(
        "--hub-url",
        default="tls://HUB-HOST:7422",
        help="Leaf URL of the hub for the fleets' configs; a cluster's nodes comma-separated.",
    )
    p.add_argument("--hub-domain", default=DEFAULT_HUB_DOMAIN, help="JetStream domain the hub runs (with --fleet).")
    p.add_argument("--leaf-listen", default=DEFAULT_LEAF_LISTEN, help="Where the hub listens for leaf nodes.")
    p.add_argument(
        "--allow-ephemeral-consumers",
        action="store_true",
        help="Also let readers create ordered consumers (for actors not yet moved to direct-get readers; weaker, "
        "see docs/security.md).",
    )
    p.add_argument("--force", action="store_true", help="Replace an existing bundle (rotates every key).")
    return p


def main_creds(argv: list[str] | None = None) -> int:
    """Entry point of ``miles creds``; returns the exit status (``--help`` exits through argparse)."""
    try:
        args = build_parser().parse_args(argv)
        check_run_name(args.run)
        out = Path(args.out) if args.out else Path("runs") / args.run / "auth"
        for host in args.hostname:
            if not host or any(c.isspace() for c in host):
                raise CredentialsError(f"invalid --hostname {host!r}")
        bundle = write_bundle(
            out,
            args.run,
            hostnames=args.hostname,
            days=args.days,
            server_dir=args.server_dir,
            fleet_dir=args.fleet_dir,
            ephemeral_consumers=args.allow_ephemeral_consumers,
            ca_dir=args.ca_dir,
            fleets=args.fleet,
            hub_url=args.hub_url,
            hub_domain=args.hub_domain,
            leaf_listen=args.leaf_listen,
            force=args.force,
        )
    except (UsageError, CredentialsError, ValueError) as exc:
        print(f"miles creds: {exc}", file=sys.stderr)
        return 2
    print(f"credentials of run {args.run!r} in {bundle}")
    print(f"  {'server:':12s}include {bundle / 'server' / 'server.conf'} in the nats-server config")
    for role in ROLES:
        print(f"  {role + ':':12s}copy {bundle / role}/ to its hosts (bus.credentials_dir)")
    for fleet in args.fleet:
        print(f"  fleet {fleet}: copy {bundle / 'fleets' / fleet}/ to the fleet's server (leafnode.conf)")
    if args.fleet:
        print(f"  the hub must run `jetstream {{ domain: {args.hub_domain} }}`")
    print(f"  keep {bundle / 'ca'} offline (it only issues more certificates)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main_creds())
