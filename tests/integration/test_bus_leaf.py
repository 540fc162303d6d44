"""A remote rollout fleet behind a leaf node, on a hub cluster: the run completes through node loss and a cut link.

Real servers and real ``miles-node`` processes, secured as docs/security.md describes (one ``miles creds``
bundle with a fleet ``cloud``):

* the hub: a 3-node JetStream cluster in domain ``hub`` (R3 streams) with the run's accounts, TLS and a
  leaf listener on each node; the controller and the trainer connect to it (every node's URL);
* the remote site: a leaf node without JetStream (the fleet's generated config, dialling every hub node),
  and two rollout workers that connect only to it. Their JetStream requests cross the link into the hub's
  domain (``default_js_domain``), so prompts, trajectories, weight chunks and announcements all travel
  through the one leaf connection.

Mid-run, the leaf server is SIGKILLed (every remote worker loses its server and waits) and, while it is
down, so is the hub node its link was on; the leaf comes back after a few seconds and must dial another hub
node; the run goes on on two hub nodes, then the lost one comes back. Nothing is restarted by a supervisor; the run
must complete, and its accounting is checked from the hub's own streams.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest

from miles.bus.cluster import NatsCluster
from miles.bus.server import EmbeddedNats
from miles.bus.setup import setup_run
from miles.config import RunConfig
from miles.ports import free_port
from miles.prepare import prepare
from miles.security.bundle import server_config, write_bundle
from miles.security.fleet import leaf_config_for
from miles.security.nkey import KeyPair
from tests.integration.harness import Cluster, check_stream_accounting, read_stream_record, small_run_config

pytestmark = pytest.mark.slow

RUN = "leafrun"
LEAF_LISTEN = "LEAF-LISTEN"  # the bundle's hub leaf listener, made per node below (one host, three ports)
REMOTE = ("remote-0", "remote-1")


def auditor(bundle: Path, root: Path) -> tuple[str, Path]:
    """An operator's login without permission limits in the run's account, for the test's own accounting (no
    role may read every stream the accounting reads): (its user entry for server.conf, a bundle root whose
    controller/ directory logs in as it)."""
    keys = KeyPair.generate("user")
    shutil.copytree(bundle / "controller", root / "controller")
    (root / "controller" / "user.nk").write_text(keys.seed + "\n")
    return f'    {{"nkey": "{keys.public_key}"}}\n', root


def start_hub(root: Path, bundle: Path, extra_user: str) -> tuple[NatsCluster, list[int]]:
    """Three routed nodes, each with the bundle's server.conf (plus ``extra_user`` in the run's account) and its
    own leaf port; returns (cluster, leaf ports)."""
    hub = NatsCluster(root, js_domain="hub", scheme="tls")
    leaf_ports = [free_port() for _ in hub.nodes]
    conf = server_config(bundle)
    assert f'"{LEAF_LISTEN}"' in conf and "  users: [\n" in conf
    conf = conf.replace("  users: [\n", "  users: [\n" + extra_user, 1)
    for node, port in zip(hub.nodes, leaf_ports, strict=True):
        node.extra_config += conf.replace(LEAF_LISTEN, f"127.0.0.1:{port}")
    return hub.start(), leaf_ports


def linked_node(hub: NatsCluster) -> int | None:
    """The hub node the leaf is connected to (None while the link is down)."""
    for i, node in enumerate(hub.nodes):
        if node.running and node.varz().get("leafnodes", 0) >= 1:
            return i
    return None


def wait_for_link(hub: NatsCluster, leaf: EmbeddedNats, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        i = linked_node(hub)
        if i is not None:
            return i
        time.sleep(0.1)
    raise AssertionError(f"the leaf link did not come up: {leaf.log_path.read_text()[-800:]}")


def run_config(model_cache: Path, bundle: Path) -> RunConfig:
    cfg = small_run_config(
        model_cache,
        RUN,
        **{
            # Room for the test to react: before the link is cut the run goes as fast as it can (a fresh-clone CI
            # run recorded 9 steps by the time the link was back, with 10 steps in all, leaving none to cross
            # it); while cut, admission holds it to max_staleness + 1 steps.
            "trainer.steps": 24,
            "eval.every": 8,
            "trainer.checkpoint_every": 50,  # nobody kills the trainer: no checkpoint before the end
            "bus.replicas": 3,
            "bus.outage_budget_s": 60.0,
            "bus.credentials_dir": str(bundle),
            "monitor.plots": False,
        },
    )
    prepare(cfg)
    return cfg


def applied_versions(cluster: Cluster, name: str) -> list[int]:
    return [json.loads(line)["version"] for line in cluster.log(name).splitlines() if '"weights_applied"' in line]


def test_a_remote_fleet_through_a_leaf_node_survives_a_lost_hub_node_and_a_cut_link(
    tmp_path: Path, model_cache: Path
) -> None:
    bundle = write_bundle(tmp_path / "auth", RUN, fleets=["cloud"], leaf_listen=LEAF_LISTEN)
    audit_user, audit_bundle = auditor(bundle, tmp_path / "audit")
    hub, leaf_ports = start_hub(tmp_path / "hub", bundle, audit_user)
    hub_leaf_urls = ",".join(f"tls://127.0.0.1:{p}" for p in leaf_ports)
    leaf = EmbeddedNats(
        tmp_path / "fleet",
        port=free_port(),
        server_name="fleet-cloud",
        jetstream=False,
        extra_config=leaf_config_for(bundle, "cloud", hub_url=hub_leaf_urls, listen=None),
    )
    cluster: Cluster | None = None
    try:
        cfg = run_config(model_cache, bundle)
        asyncio.run(setup_run(cfg.bus, hub.url, RUN))  # the setup role creates the R3 streams on the hub
        leaf.start_sync()
        wait_for_link(hub, leaf)
        cluster = Cluster(cfg=cfg, run_dir=tmp_path / "run", nats_url=hub.url)
        cluster.start("controller", "controller")
        cluster.start_trainer()
        for name in REMOTE:
            cluster.start(name, "rollout", nats_url=leaf.url)  # the remote site knows only its leaf node

        # The leaf server is cut off: every remote worker loses its server and waits. The run cannot end
        # meanwhile: no trajectory is made, and admission lets the trainer run at most max_staleness + 1
        # steps ahead of what was generated.
        cluster.wait_for(lambda: cluster.steps_recorded() >= 1, 120, "the first step")
        lost = wait_for_link(hub, leaf)
        leaf.kill()
        # While the link is down, the hub node it was on is lost too: the hub's actors move to the other
        # nodes, the R3 streams it led elect new leaders, and the leaf, once back, must dial another node.
        hub.kill(lost)
        time.sleep(4.0)
        leaf.start_sync()
        assert wait_for_link(hub, leaf) != lost
        assert not (cluster.run_dir / "summary.json").exists(), "the run ended without its remote workers"
        restored_at = cluster.steps_recorded()
        cluster.wait_for(lambda: cluster.steps_recorded() > restored_at, 120, f"a step without hub node {lost}")
        hub.restart(lost)

        cluster.wait_for(lambda: (cluster.run_dir / "summary.json").exists(), 180, "the end of the run")
        cluster.wait_all_exit(90)
        for name, proc in cluster.procs.items():
            assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{cluster.log(name)[-2000:]}"
        audit_cfg = cfg.model_copy(update={"bus": cfg.bus.model_copy(update={"credentials_dir": str(audit_bundle)})})
        record = asyncio.run(read_stream_record(hub.url, audit_cfg, role="controller"))
        check_stream_accounting(cluster, record)  # nothing lost, nothing trained twice
    finally:
        if cluster is not None:
            cluster.stop()
        leaf.stop_sync()
        hub.stop()

    summary = cluster.summary()
    # Every trajectory came from the remote site, and every trained one had the trainer's weights checked.
    assert set(summary["workers"]) == set(REMOTE)
    assert summary["weights_mismatches"] == 0 and summary["weights_verified"] >= 1
    for name in REMOTE:
        log = cluster.log(name)
        assert "nats_disconnected" in log and "nats_reconnected" in log, f"{name} never lost its leaf node"
        assert applied_versions(cluster, name), f"{name} never received weights through the link"
        # A chunk request in flight when the leaf died is asked again after the reconnect (miles.bus.request),
        # not waited out: its 60 s timeout once stalled a worker's weights until after the run had ended.
        stalled = [line for line in log.splitlines() if '"weights_fetch_failed"' in line and "timed out" in line]
        assert not stalled, f"{name}: {stalled}"
    # Weights published after the link came back crossed it: the last step trained trajectories at most
    # max_staleness versions old, and only the remote site made trajectories. (Not asked of each worker: once
    # the link is back the run's last steps may take under a second, and a worker that holds no group then
    # may be stopped before its follower fetched them.)
    applied = {name: applied_versions(cluster, name) for name in REMOTE}
    newest = max(max(versions) for versions in applied.values())
    assert newest >= cfg.trainer.steps - 1 - cfg.staleness.max_staleness > restored_at, applied
