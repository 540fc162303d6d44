"""The setup step: create a run's streams, consumers and buckets before any actor starts.

With per-role credentials it runs as the ``setup`` identity, the only one allowed to create JetStream
objects (docs/security.md); the actors then only bind. On an open bus every actor also does it at
start, so the step is optional there. Idempotent: re-running it on a live run changes nothing.
"""

from __future__ import annotations

import structlog

from miles.bus.connect import close_client, connect
from miles.bus.errors import BusError
from miles.bus.retry import Outage, resilient_jetstream
from miles.bus.streams import ensure_run_streams
from miles.bus.subjects import Subjects
from miles.config import BusConfig

log = structlog.get_logger(__name__)


async def setup_run(cfg: BusConfig, url: str, run: str) -> None:
    """Connect as ``setup`` (``cfg.credentials_dir``) or anonymously, and create the run's JetStream objects."""
    extra = None
    if cfg.credentials_dir is not None:
        from miles.security.bundle import CredentialsError, RoleCredentials

        try:
            creds = RoleCredentials.load(cfg.credentials_dir, "setup")
        except CredentialsError as exc:
            raise BusError(f"bus.credentials_dir: {exc}") from None
        if creds.run != run:
            raise BusError(f"bus.credentials_dir holds the credentials of run {creds.run!r}, not {run!r}")
        extra = creds.nats_options()
    outage = Outage(budget_s=cfg.outage_budget_s)
    nc = await connect(
        url,
        name=f"{run}:setup",
        creds=cfg.creds,
        tls_ca=cfg.tls_ca,
        tls_cert=cfg.tls_cert,
        tls_key=cfg.tls_key,
        extra_options=extra,
        outage=outage,
    )
    try:
        # a fresh cluster may still elect leaders
        js = resilient_jetstream(nc, outage, timeout=cfg.request_timeout_s, domain=cfg.js_domain)
        await ensure_run_streams(js, Subjects(run), replicas=cfg.replicas, ack_wait_s=cfg.ack_wait_s)
    finally:
        await close_client(nc)  # past the outage budget too, without hiding why
    log.info("run_set_up", run=run, url=url, identity="setup" if extra else "anonymous")
