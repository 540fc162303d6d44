"""``--allow-ephemeral-consumers``: today's ordered-consumer readers work, at a price shown here.

With the extra grants, the follower's, the controller's and the monitor's nats-py ordered consumers
and the controller's self-created durables work unchanged. The price: whoever may create a consumer
chooses its ``deliver_subject``, and the server publishes there on its own authority, so a rollout
worker can have its own bytes re-delivered on a subject it may not publish to. The strict default
refuses the consumer creation (``test_permissions.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgpack
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from miles.bus.connect import processed
from miles.bus.server import EmbeddedNats
from miles.security.bundle import server_config, write_bundle
from tests.integration.test_permissions import RUN, S, Session, connect_as, pack, prepare_run, publish_weights


@pytest.fixture(scope="module")
def compat_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bundle(tmp_path_factory.mktemp("auth") / "auth", RUN, ephemeral_consumers=True)


@pytest.fixture
async def roles(tmp_path: Path, compat_bundle: Path) -> AsyncIterator[Callable[[str], Awaitable[Session]]]:
    sessions: list[Session] = []
    async with EmbeddedNats(tmp_path / "bus", extra_config=server_config(compat_bundle)) as srv:

        async def open_(role: str) -> Session:
            session = await connect_as(srv.url, compat_bundle, role)
            sessions.append(session)
            return session

        await prepare_run((await open_("setup")).js)
        yield open_
        for session in sessions:
            if not session.nc.is_closed:
                await session.nc.close()


async def test_ordered_consumers_and_self_made_durables_work(roles: Callable[[str], Awaitable[Session]]) -> None:
    rollout, controller, monitor, trainer = [await roles(r) for r in ("rollout", "controller", "monitor", "trainer")]
    await publish_weights(trainer, 0)
    await publish_weights(trainer, 1)
    for reader in (rollout, controller):  # miles/sync/follower.py, miles/actors/controller.py
        last = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)  # nats-py fills it in: one each
        sub = await reader.js.subscribe(S.weights, ordered_consumer=True, config=last)
        assert msgpack.unpackb((await sub.next_msg(timeout=5)).data)["version"] == 1
        await sub.unsubscribe()
    await trainer.js.publish(S.step, pack("step_metrics", step=0))
    metrics = await monitor.js.subscribe(S.metrics_all, ordered_consumer=True)  # miles/actors/monitor.py
    assert (await metrics.next_msg(timeout=5)).subject == S.step
    await metrics.unsubscribe()
    config = ConsumerConfig(durable_name="controller-discards", filter_subject=S.discarded, ack_wait=30.0)
    sub = await controller.js.pull_subscribe(
        S.discarded, durable="controller-discards", stream=S.events_stream, config=config
    )
    await trainer.js.publish(S.discarded, pack("groups_discarded", group_ids=[]))
    (msg,) = await sub.fetch(1, timeout=5)
    await msg.ack_sync()
    config = ConsumerConfig(durable_name="controller-metrics", filter_subject=S.metrics_all, ack_wait=30.0)
    sub = await controller.js.pull_subscribe(
        S.metrics_all, durable="controller-metrics", stream=S.metrics_stream, config=config
    )
    (msg,) = await sub.fetch(1, timeout=5)
    await msg.ack_sync()
    for session in (rollout, controller, monitor, trainer):
        await processed(session.nc)
        assert session.clean() == []


async def test_a_consumer_creator_can_make_the_server_publish_for_it(
    roles: Callable[[str], Awaitable[Session]],
) -> None:
    """The rollout worker may not publish a trainer heartbeat, but a consumer it creates delivers its own
    bytes (published on ``weights_held``, which it may) to whoever listens on that subject by name."""
    rollout, controller = await roles("rollout"), await roles("controller")
    forged = S.heartbeat("trainer", "t0")
    assert await rollout.refused_publish(forged)
    watcher = await controller.nc.subscribe(forged)  # e.g. a dashboard that watches the trainer
    await processed(controller.nc)
    await rollout.js.publish(S.weights_held, pack("heartbeat", role="trainer", actor_id="t0", state="forged"))
    redirect = ConsumerConfig(deliver_subject=forged, filter_subject=S.weights_held, ack_policy=AckPolicy.NONE)
    await rollout.js.add_consumer(S.events_stream, redirect)
    msg = await watcher.next_msg(timeout=5)
    assert msgpack.unpackb(msg.data) == {
        "schema": 1,
        "kind": "heartbeat",
        "role": "trainer",
        "actor_id": "t0",
        "state": "forged",
    }
    await watcher.unsubscribe()
