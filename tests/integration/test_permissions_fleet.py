"""A rollout fleet behind a leaf node: its workers do their work through the link, and the hub decides
what crosses, even when the fleet's own server lets its clients publish anything.

Two real servers: the hub (the run's server.conf, JetStream domain ``hub``, a leaf listener) and the
fleet's leaf node (its generated config, no JetStream). Workers connect to the leaf only.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from miles.bus.connect import processed
from miles.bus.follow import last_message
from miles.bus.server import EmbeddedNats
from miles.security.bundle import server_config, write_bundle
from miles.security.fleet import leaf_config_for
from miles.sync.transport.dataplane import WeightStore
from tests.integration.test_permissions import (
    ADMIN_API,
    CONTROLLER_ONLY,
    RUN,
    STEAL_WORK,
    TRAINER_ONLY,
    S,
    Session,
    connect_as,
    pack,
    prepare_run,
    publish_weights,
    stored_messages,
)

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class HubNats(EmbeddedNats):
    """The embedded server with a JetStream domain (EmbeddedNats has no option for it yet)."""

    def _render_config(self) -> str:
        return super()._render_config().replace("jetstream {\n", 'jetstream {\n  domain: "hub"\n', 1)


class LeafNats(EmbeddedNats):
    """The embedded server without JetStream, as a fleet's leaf node runs."""

    def _render_config(self) -> str:
        return re.sub(r"jetstream \{\n[^}]*\}\n", "", super()._render_config(), count=1)

    def _healthy(self) -> bool:
        return self._monitor_url is not None and _varz(self._monitor_url) is not None


def _varz(monitor_url: str) -> dict | None:
    try:
        with _NO_PROXY.open(f"{monitor_url}/varz", timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("auth")
    return write_bundle(root / "auth", RUN, fleets=["cloud"], leaf_listen="127.0.0.1:-1")


async def start_fleet(tmp_path: Path, hub: EmbeddedNats, leaf_config: str) -> LeafNats:
    varz = _varz(hub.monitor_url)
    assert varz is not None
    hub_url = f"tls://127.0.0.1:{varz['leaf']['port']}"
    leaf = LeafNats(tmp_path / "fleet", extra_config=leaf_config.replace("HUB-URL", hub_url), server_name="fleet")
    await leaf.start()
    for _ in range(200):  # the link is up once the hub counts it
        if (_varz(hub.monitor_url) or {}).get("leafnodes", 0) >= 1:
            await asyncio.sleep(0.2)  # and the interest it carries has been exchanged
            return leaf
        await asyncio.sleep(0.05)
    await leaf.stop()
    raise AssertionError(f"the leaf link did not come up: {leaf.log_path.read_text()[-800:]}")


@pytest.fixture
async def hub(tmp_path: Path, bundle: Path) -> AsyncIterator[EmbeddedNats]:
    async with HubNats(tmp_path / "hub", extra_config=server_config(bundle), server_name="hub") as srv:
        yield srv


async def run_on_hub(hub: EmbeddedNats, bundle: Path) -> dict[str, Session]:
    sessions = {role: await connect_as(hub.url, bundle, role) for role in ("setup", "trainer", "controller")}
    await prepare_run(sessions["setup"].js)
    await publish_weights(sessions["trainer"], 0, b"f" * 4000)
    await sessions["controller"].js.publish(S.prompts, pack("prompt_group", group_id="g0"))
    return sessions


async def close(*sessions: Session) -> None:
    for session in sessions:
        if not session.nc.is_closed:
            await session.nc.close()


async def test_fleet_workers_work_through_the_leaf_link(tmp_path: Path, hub: EmbeddedNats, bundle: Path) -> None:
    on_hub = await run_on_hub(hub, bundle)
    leaf = await start_fleet(tmp_path, hub, leaf_config_for(bundle, "cloud", hub_url="HUB-URL", listen=None))
    try:
        worker = await connect_as(leaf.url, bundle, "rollout")
        prompts = await worker.js.pull_subscribe_bind(durable=S.ROLLOUT_CONSUMER, stream=S.prompts_stream)
        (msg,) = await prompts.fetch(1, timeout=5)
        await worker.js.publish(S.traj, pack("trajectory", group_id="g0"))
        await msg.ack_sync()
        announcement = await last_message(worker.js, S.events_stream, S.weights)
        assert announcement is not None
        store = WeightStore(worker.js, RUN, chunk_bytes=1024, keep_versions=2, fetch="client")
        assert bytes(await store.get(0)) == b"f" * 4000
        await worker.js.publish(S.weights_held, pack("weights_held", worker_id="cloud-0", version=0))
        # the fleet's own server enforces the rollout role too
        assert await worker.refused_publish(S.weights)
        await processed(worker.nc)
        assert [e for e in worker.clean() if S.weights not in e] == []
        stored = await stored_messages(on_hub["setup"])
        assert stored[S.traj_stream] == 1 and stored[S.events_stream] == 2  # announcement + held report
        await close(worker)
    finally:
        await close(*on_hub.values())
        await leaf.stop()


async def test_a_careless_fleet_server_still_cannot_send_what_rollout_may_not(
    tmp_path: Path, hub: EmbeddedNats, bundle: Path
) -> None:
    on_hub = await run_on_hub(hub, bundle)
    # the fleet's operator dropped the rollout permissions on its own server: anything goes locally
    careless = re.sub(
        r'(\{"nkey": "U[A-Z0-9]+"), "permissions": .*\}\}\}',
        r"\1}",
        leaf_config_for(bundle, "cloud", hub_url="HUB-URL", listen=None),
    )
    assert '"permissions"' not in careless
    leaf = await start_fleet(tmp_path, hub, careless)
    try:
        worker = await connect_as(leaf.url, bundle, "rollout")
        before = await stored_messages(on_hub["setup"])
        for subject in TRAINER_ONLY + CONTROLLER_ONLY:
            await worker.nc.publish(subject, pack("weights_announced", version=99))
        await processed(worker.nc)
        for api in ADMIN_API + STEAL_WORK:  # JetStream API the link may not use: not even routed
            with pytest.raises(Exception):
                await worker.nc.request(api, b"{}", timeout=1)
        await asyncio.sleep(0.5)
        assert await stored_messages(on_hub["setup"]) == before
        assert worker.clean() == []  # nothing refused locally: the hub dropped it
        await close(worker)
    finally:
        await close(*on_hub.values())
        await leaf.stop()
